"""Loading a GGUF streams: a synthetic ~300M-parameter llama-shaped Q4_0 file (written once, a tensor
at a time, never as a float model) loads with a peak rise in resident memory within 1.1x of the
weights the model then holds (no second copy of any tensor, the file's pages unmapped tensor by
tensor), and those bytes are kv-estimate's figure for the file."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import REPO
from gguf_util import write_random_gguf
from llmopt.kernels import cpu_quant

pytestmark = pytest.mark.skipif(cpu_quant.ops() is None, reason="needs the C++ kernels (g++, AVX2)")

SHAPE = SimpleNamespace(vocab_size=97, hidden_size=1024, intermediate_size=4096, num_hidden_layers=20,
                        num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                        rms_norm_eps=1e-5)

CHILD = r"""
import json, sys, torch
from llmopt.kernels import cpu_quant
from llmopt.models.loader import load_model, load_tokenizer, resolve

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

path = sys.argv[1]
load_tokenizer(resolve(path).folder)           # the config and tokenizer cached: not the weights
cpu_quant.ops()
with torch.device("meta"):                     # torch's lazy imports of a first meta init
    torch.nn.Embedding(2, 2)
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark starts again from here
before = status("VmRSS")
m = load_model(path, "float32", "cpu", tokenizer=False).model
held = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()]) - m.inv_freq.nbytes
print(json.dumps({"peak_rise": status("VmHWM") - before, "held": held}))
"""


def test_a_300m_q4_0_file_loads_with_one_copy_of_its_weights(tmp_path):
    path = tmp_path / "synthetic-300m.Q4_0.gguf"
    file_bytes = write_random_gguf(path, SHAPE, "Q4_0")
    env = {"PYTHONPATH": str(REPO), "LLMOPT_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    params = 2 * 97 * 1024 + 20 * (2 * 1024 * 1024 + 2 * 256 * 1024 + 3 * 4096 * 1024)
    assert params > 290e6 and file_bytes == params * 18 // 32 + (41 * 1024) * 4
    from llmopt.estimate import resolve_model_arch
    from llmopt.estimate.weights import weight_memory
    import os
    os.environ["LLMOPT_CACHE"] = str(tmp_path / "cache")
    assert got["held"] == weight_memory(resolve_model_arch(str(path)), device="cpu").bytes_total
    assert got["held"] == params * 6 // 8 + 41 * 1024 * 4   # 4-bit codes, float32 scale and scaled zero per 32
    assert got["peak_rise"] <= 1.1 * got["held"], got
