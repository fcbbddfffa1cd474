"""A GGUF file run as stored: llmopt against llama.cpp's `llama-bench` on the same file, in one run.

For each round (alternating, each system alone on the machine, each in its own process):
- `llama-bench -m FILE -n 128 -p 512 -t THREADS -r 3 -o json`: tg128 and pp512 tokens/s;
- llmopt on the same file (LLMEngine, greedy, EOS ignored): tg128 (one BOS prompt, 128 tokens,
  first to last token) and pp512 (one 512-token prompt, one output token, `--max-num-batched-tokens
  512` so it is one step as llama-bench's batch is), each the median of 3;
- both: the process's peak resident memory (`/usr/bin/time -f %M`); for llmopt also the bytes of
  weights the model holds, the load's time and its rise in resident memory (after the tokenizer, the
  C++ library and torch's lazy imports are loaded); the engine adds a 64 MiB KV cache.

    scripts/peer_llamacpp.sh tools      # builds .venv-llamacpp/bin/llama-bench
    python scripts/bench_gguf.py [--model FILE.gguf] [--rounds 2] [--threads 2]
    python scripts/bench_gguf.py --synthetic Q4_K,Q6_K --activations int8   # K-quants (speed only)

`--synthetic TYPES`: for each GGML type a 0.5B-parameter llama-shaped file (hidden 2048, MLP 8192,
8 layers, 32 heads, 8 KV heads; a 97-token vocabulary) of random blocks of that type, written to a
temporary folder (no K-quant model ships with the toolkit; the numbers are speed and memory only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LLMOPT_CHILD = r"""
import json, sys, time
path, threads, int8 = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "int8"
dtype = sys.argv[4] if len(sys.argv) > 4 else "float32"   # a folder's --dtype (auto: 16-bit stays 16-bit)
kv_bytes = int(sys.argv[5]) if len(sys.argv) > 5 else 64 << 20
import torch
torch.set_num_threads(threads)
from llmopt import SamplingParams, defaults
defaults.CPU_DECODE_INT8_ACTIVATIONS = int8
from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.errors import ModelLoadError
from llmopt.models.loader import load_tokenizer, resolve

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024

try:
    tok = load_tokenizer(resolve(path).folder)
except ModelLoadError:                            # a synthetic checkpoint: token ids only
    tok = None
from llmopt.kernels import cpu_quant
from llmopt.models.loader import load_model
cpu_quant.ops()                                   # the C++ library: code, not weights
with torch.device("meta"):                        # torch's lazy imports of a first meta init (dynamo, triton)
    torch.nn.Embedding(2, 2)
before, t0 = rss(), time.perf_counter()
loaded = load_model(path, dtype, "cpu", tokenizer=False)
load_s, rise = time.perf_counter() - t0, rss() - before
loaded.tokenizer = tok
m = loaded.model
held = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
engine = LLMEngine(EngineArgs(model=path, dtype=dtype, device="cpu", max_model_len=1024, detokenize=False,
                              enable_prefix_caching=False, max_num_batched_tokens=512, kv_cache_memory=kv_bytes),
                   loaded=loaded)

def run(prompt, n):
    engine.add_request("r", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        engine.step()
        times.append(time.perf_counter())
    return times

bos = engine.loaded.config.bos_token_id or 1
run([bos] * 16, 8)                                # warm-up
pp, tg = [], []
for i in range(3):
    vocab = engine.loaded.config.vocab_size   # (a synthetic file's 97 tokens too)
    prompt = [(100 + i * 7919 + j * 37) % vocab for j in range(512)]
    t = time.perf_counter()
    run(prompt, 1)
    pp.append(512 / (time.perf_counter() - t))
    times = run([bos], 129)
    tg.append(128 / (times[-1] - times[0]))
print(json.dumps({"pp512": pp, "tg128": tg, "load_s": load_s, "weights_bytes": held, "load_rss_rise": rise}))
"""


def timed(cmd: list[str], env: dict | None = None) -> tuple[str, int]:
    """(stdout, peak resident bytes) of a command run under /usr/bin/time."""
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as f:
        r = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", f.name, *cmd], capture_output=True, text=True,
                           env=env, timeout=3600)
        if r.returncode:
            raise SystemExit(f"{cmd[0]} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
        return r.stdout, int(f.read().split()[-1]) * 1024


def llama_bench(binary: Path, model: Path, threads: int) -> dict:
    out, peak = timed([str(binary), "-m", str(model), "-n", "128", "-p", "512", "-t", str(threads), "-r", "3",
                       "-o", "json"])
    rows = json.loads(out)
    get = {("pp512" if r["n_prompt"] else "tg128"): r["avg_ts"] for r in rows}
    return {"system": "llama-bench", **get, "peak_rss": peak}


def llmopt(model: Path, threads: int, acts: str, dtype: str = "float32", label: str | None = None,
           kv_bytes: int = 64 << 20) -> dict:
    """llmopt's run on a .gguf file or a checkpoint folder (`dtype`: its --dtype; a KV cache of kv_bytes)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out, peak = timed([sys.executable, "-c", LLMOPT_CHILD, str(model), str(threads), acts, dtype, str(kv_bytes)], env)
    r = json.loads(out.strip().splitlines()[-1])
    return {"system": label or f"llmopt ({acts} activations)", "pp512": statistics.median(r.pop("pp512")),
            "tg128": statistics.median(r.pop("tg128")),
            **r, "peak_rss": peak}


def main() -> None:
    from llmopt import defaults
    from llmopt.models.config import builtin_gguf
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a .gguf file (default: the built-in model's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--llama-bench", default=str(ROOT / ".venv-llamacpp" / "bin" / "llama-bench"))
    ap.add_argument("--activations", default="int8,float",
                    help="llmopt's runs: int8 (the default) and/or float activations, comma-separated")
    ap.add_argument("--synthetic", help="GGML types, comma-separated: a synthetic 0.5B file of each (above)")
    a = ap.parse_args()
    if a.synthetic:
        with tempfile.TemporaryDirectory() as tmp:
            for kind in a.synthetic.split(","):
                print(f"== synthetic 0.5B {kind}", flush=True)
                bench(synthetic(Path(tmp), kind.strip().upper()), a)
        return
    bench(Path(a.model) if a.model else builtin_gguf(defaults.DEFAULT_MODEL), a)


def synthetic(folder: Path, kind: str) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))   # the tests' GGUF writer: random blocks of any run type
    from types import SimpleNamespace
    from gguf_util import write_random_gguf
    path = folder / f"synthetic-0.5b.{kind}.gguf"
    write_random_gguf(path, SimpleNamespace(vocab_size=97, hidden_size=2048, intermediate_size=8192,
                                            num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8,
                                            head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5), kind)
    return path


def bench(model: Path, a) -> None:
    acts = [x.strip() for x in a.activations.split(",") if x.strip()]
    rows = []
    for i in range(a.rounds):
        runs = [lambda: llama_bench(Path(a.llama_bench), model, a.threads)]
        runs += [lambda act=act: llmopt(model, a.threads, act) for act in acts]
        for fn in runs:
            row = {"round": i, "load_1min": os.getloadavg()[0], **fn()}
            print(json.dumps(row), flush=True)
            rows.append(row)
    peer = [r for r in rows if r["system"] == "llama-bench"]
    for act in acts:
        ours = [r for r in rows if r["system"] == f"llmopt ({act} activations)"]
        for key in ("tg128", "pp512"):
            ratios = [o[key] / p[key] for o, p in zip(ours, peer)]
            print(f"{key}, {act} activations: llmopt {', '.join(f'{o[key]:.1f}' for o in ours)} tok/s; llama-bench "
                  f"{', '.join(f'{p[key]:.1f}' for p in peer)}; ratio {', '.join(f'{x:.2f}x' for x in ratios)}")
    o = ours[-1]
    print(f"peak RSS: llmopt {o['peak_rss'] / 1e6:.0f} MB (weights held {o['weights_bytes'] / 1e6:.1f} MB; load "
          f"{o['load_s']:.1f} s, resident rise {o['load_rss_rise'] / 1e6:.1f} MB); llama-bench "
          f"{peer[-1]['peak_rss'] / 1e6:.0f} MB; file {model.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
