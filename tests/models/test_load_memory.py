"""Loading streams: a synthetic ~300M-parameter llama-shaped checkpoint (written once, a tensor at a
time, never as a float32 model) loads with a peak rise in resident memory within 1.1x of what the
engine then holds (no second copy of any tensor), and those bytes are kv-estimate's figure:
- as a Q4_0 GGUF: the weights held at the file's bytes (4-bit codes and the fp16 d; the zero
  implied), the file's pages unmapped tensor by tensor: the rise within 1.1x the file's tensor bytes;
- as a bfloat16 safetensors folder: the weights held 16-bit (`--dtype auto` on the CPU) plus the
  KV cache of an engine built over them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO
from gguf_util import write_random_gguf
from llmopt.kernels import cpu_quant

pytestmark = pytest.mark.skipif(cpu_quant.ops() is None, reason="needs the C++ kernels (g++, AVX2)")

SHAPE = SimpleNamespace(vocab_size=97, hidden_size=1024, intermediate_size=4096, num_hidden_layers=20,
                        num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                        rms_norm_eps=1e-5)

# PRELUDE: the children's imports; MEASURE: the C++ library and torch's lazy imports of a first meta
# init loaded (code, not weights), then the high-water mark starts again from there
PRELUDE = r"""
import json, sys, torch
from llmopt.kernels import cpu_quant
from llmopt.models.loader import load_model, load_tokenizer, resolve

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

path = sys.argv[1]
"""
MEASURE = r"""
cpu_quant.ops()
with torch.device("meta"):
    torch.nn.Embedding(2, 2)
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
"""

# a first load of a tiny file of the same format (argv[2]): the code it runs paged in (library pages
# count in the resident set: 4-9 MB, varying with the machine), its weights freed before measuring
CHILD = PRELUDE + r"""
load_tokenizer(resolve(path).folder)           # the config and tokenizer cached: not the weights
load_tokenizer(resolve(sys.argv[2]).folder)
import gc
load_model(sys.argv[2], "float32", "cpu", tokenizer=False)
gc.collect()
""" + MEASURE + r"""
m = load_model(path, "float32", "cpu", tokenizer=False).model
held = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()]) - m.inv_freq.nbytes
print(json.dumps({"peak_rise": status("VmHWM") - before, "held": held}))
"""


PARAMS = 2 * 97 * 1024 + 20 * (2 * 1024 * 1024 + 2 * 256 * 1024 + 3 * 4096 * 1024)
NORMS = 41 * 1024   # the norms' weights; PARAMS: the matrices'


def _run(child: str, path, tmp_path, *more) -> dict:
    env = {"PYTHONPATH": str(REPO), "LLMOPT_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", child, str(path), *map(str, more)], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_300m_q4_0_file_loads_with_one_copy_of_its_weights(tmp_path):
    path = tmp_path / "synthetic-300m.Q4_0.gguf"
    file_bytes = write_random_gguf(path, SHAPE, "Q4_0")
    tiny = tmp_path / "tiny.Q4_0.gguf"
    write_random_gguf(tiny, SimpleNamespace(**{**vars(SHAPE), "hidden_size": 128, "intermediate_size": 256,
                                               "num_hidden_layers": 1, "num_attention_heads": 2,
                                               "num_key_value_heads": 1}), "Q4_0")
    got = _run(CHILD, path, tmp_path, tiny)
    assert PARAMS > 290e6 and file_bytes == PARAMS * 18 // 32 + NORMS * 4
    from llmopt.estimate import resolve_model_arch
    from llmopt.estimate.weights import weight_memory
    import os
    os.environ["LLMOPT_CACHE"] = str(tmp_path / "cache")
    assert got["held"] == weight_memory(resolve_model_arch(str(path)), device="cpu").bytes_total
    matrices = 2 + 7 * SHAPE.num_hidden_layers
    assert got["held"] == file_bytes + 2 * matrices   # the file's bytes, and each matrix's fp16 zero code (8)
    assert got["peak_rise"] <= 1.1 * file_bytes, got


CHILD_BF16 = PRELUDE + r"""
from llmopt.core.sampling_params import SamplingParams
from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
""" + MEASURE + r"""
loaded = load_model(path, "auto", "cpu", tokenizer=False)
engine = LLMEngine(EngineArgs(model=path, kv_cache_memory=64 << 20, max_model_len=1024, detokenize=False),
                   loaded=loaded)
engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))   # every weight read once
while engine.has_unfinished_requests():
    engine.step()
m = loaded.model
held = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()]) - m.inv_freq.nbytes
kinds = sorted({str(t.dtype) for t in m.parameters()})
print(json.dumps({"peak_rise": status("VmHWM") - before, "held": held, "kv": engine.kv_cache_info().bytes_allocated,
                  "cpu_decode": engine.executor.cpu_decode is not None, "kinds": kinds}))
"""


def _write_bf16_checkpoint(folder):
    """The same shape as a bfloat16 Hugging Face folder, each tensor drawn in bfloat16 directly."""
    from safetensors.torch import save_file
    folder.mkdir()
    c = SHAPE
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
           "tie_word_embeddings": False, "hidden_act": "silu", "rope_theta": 10000.0, **vars(c)}
    (folder / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    h, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,),
              "lm_head.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (c.hidden_size,), p + "post_attention_layernorm.weight": (c.hidden_size,),
                       p + "self_attn.q_proj.weight": (h, c.hidden_size), p + "self_attn.k_proj.weight": (kv, c.hidden_size),
                       p + "self_attn.v_proj.weight": (kv, c.hidden_size), p + "self_attn.o_proj.weight": (c.hidden_size, h),
                       p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                       p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                       p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size)})
    tensors = {n: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g).mul_(0.02)).to(torch.bfloat16)
               for n, s in shapes.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_a_300m_bf16_checkpoint_loads_16bit_with_one_copy_of_its_weights(tmp_path):
    path = tmp_path / "synthetic-300m-bf16"
    _write_bf16_checkpoint(path)
    got = _run(CHILD_BF16, path, tmp_path)
    assert got["kinds"] == ["torch.bfloat16", "torch.float32"] and got["cpu_decode"], got
    assert got["held"] == PARAMS * 2 + NORMS * 4   # matrices 16-bit, norms float32
    from llmopt.estimate import estimate, resolve_model_arch
    assert got["held"] == estimate(resolve_model_arch(str(path)), device="cpu",
                                   kv_cache_memory=64 << 20).weights.bytes_total
    assert got["kv"] > 60 << 20
    assert got["peak_rise"] <= 1.1 * (got["held"] + got["kv"]), got
