"""Decode speed on the CPU (issue #14): single-stream decode tokens/s (64-token prompt, 256 generated,
greedy, EOS ignored) and batched output tokens/s (16 and 64 sequences), for llmopt configurations
against llama.cpp (llama-cpp-python from scripts/peer_llamacpp.sh) on the same model's Q4_1 GGUF, in
one run. Run under `PYTHONPATH=<OTHER>` for the llmopt figures of another checkout's code (the parent
commit's worktree; the first line printed names the llmopt that ran), for the batched comparison.

    python scripts/bench_decode.py --config float32 --config int8 --config awq=out/smollm2-awq \\
        --config gptq=out/smollm2-gptq --llamacpp --json out/bench_decode.json
    PYTHONPATH=../parent python scripts/bench_decode.py --config float32 --single 0   # parent: batched only

Two more modes, in place of the configurations:
- `--prefill 8x256,1x2000`: prefill tokens/s of the C++ layers (one row per prompt token) against the
  Python layers, alternating in one process (random tokens, one output token each);
- `--transformers`: offline throughput of `llmopt.LLM.generate` against transformers `generate` (left-
  padded batches of --hf-batch; and one request at a time, on the first --single-prompts prompts):
  --num-prompts prompts of 32-256 WikiText-2 tokens, max_tokens drawn from 16-256, ignore_eos, seed 0,
  float32, greedy; output tokens/s and peak memory of each (GPU: peak allocated).

Timing: single stream, from the first generated token to the last (prefill excluded); batched,
from the start to the last token (prefill included), output tokens over wall time. Speed is
measured here, never asserted in tests. Run it on an idle machine (`uptime`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

import llmopt
from benchlib import hf_folder, hf_generate_left_padded, hf_generate_single
from llmopt import LLM, SamplingParams, defaults
from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.models.config import builtin_gguf
from llmopt.models.loader import load_model

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT / ".." / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
PROMPT_LEN = 64

LLAMACPP_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
path, prompt_len, gen, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_ctx=prompt_len + gen + 8, n_threads=threads, n_threads_batch=threads,
            n_batch=prompt_len, verbose=False, seed=0)
prompt = [llm.token_bos()] + [100 + (i * 37) % 1000 for i in range(prompt_len - 1)]
times = []
for i, tok in enumerate(llm.generate(prompt, temp=0.0, top_k=1, reset=True)):
    times.append(time.perf_counter())
    if len(times) == gen:
        break
print(json.dumps({"decode_tok_s": (gen - 1) / (times[-1] - times[0])}))
"""


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, min(vocab, 30000)) for _ in range(PROMPT_LEN)] for _ in range(n)]


def make_engine(model: str | None, quantization: str | None, max_num_seqs: int, extra: dict):
    kw = dict(model=model, dtype="float32", device="cpu", max_num_seqs=max_num_seqs, detokenize=False,
              max_model_len=1024, enable_prefix_caching=False)
    kw.update(extra)   # --engine-arg (or a caller) may override the defaults above
    if quantization:
        kw["quantization"] = quantization
    return LLMEngine(EngineArgs(**kw))


def run_requests(engine, ps: list[list[int]], gen: int) -> tuple[float, float, int]:
    """(start, first token time, end) and the output tokens; one request per prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, params)
    start = time.perf_counter()
    first = None
    done = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and any(len(o.outputs[0].token_ids) for o in outs):
            first = time.perf_counter()
        done += sum(1 for o in outs if o.finished)
    return start, first, time.perf_counter()


def bench_llmopt(name: str, model: str | None, quantization: str | None, single: int, batches: list[int],
                 gen_batched: int, extra: dict) -> dict:
    res: dict = {"config": name, "load_1min": os.getloadavg()[0]}
    engine = make_engine(model, quantization, max(batches + [1]), extra)
    vocab = engine.loaded.config.vocab_size
    run_requests(engine, prompts(1, vocab, 99), 8)     # warm-up (kernel build, first-use caches)
    if single:
        _, first, end = run_requests(engine, prompts(1, vocab, 1), single)
        res["decode_tok_s"] = (single - 1) / (end - first)
    for b in batches:
        start, _, end = run_requests(engine, prompts(b, vocab, 2), gen_batched)
        res[f"batch{b}_tok_s"] = b * gen_batched / (end - start)
    print(json.dumps(res), flush=True)
    return res


def bench_llamacpp(python: Path, gguf: Path, single: int, threads: int) -> dict:
    load = os.getloadavg()[0]
    out = subprocess.run([str(python), "-c", LLAMACPP_SCRIPT, str(gguf), str(PROMPT_LEN), str(single), str(threads)],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"llama-cpp-python failed: {out.stderr.strip().splitlines()[-1:]}")
    res = {"config": "llama.cpp Q4_1", "load_1min": load, **json.loads(out.stdout.strip().splitlines()[-1])}
    print(json.dumps(res), flush=True)
    return res


# -- --prefill -------------------------------------------------------------------------------------

def bench_prefill(model: str | None, cases_arg: str, rounds: int) -> None:
    """Prefill tokens/s of the C++ layers against the Python layers, alternating, for PROMPTSxTOKENS cases."""
    cases = [tuple(int(v) for v in c.split("x")) for c in cases_arg.split(",")]
    engine = make_engine(model, None, max(n for n, _ in cases), {"max_model_len": max(64, *(t for _, t in cases)) + 8})
    runner, rng = engine.runner, random.Random(0)
    cpp = runner.cpu_decode
    if cpp is None:
        raise SystemExit("the C++ layers do not apply to this model here")

    def prefill(n: int, tokens: int) -> float:
        for i in range(n):
            engine.add_request(f"{tokens}-{i}-{time.perf_counter_ns()}", [rng.randrange(100, 30000) for _ in range(tokens)],
                               SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t

    prefill(1, 64)   # warm-up
    rows = []
    for n, tokens in cases:
        for r in range(rounds):
            for name, layers in (("python", None), ("c++", cpp)):
                runner.cpu_decode = layers
                dt = prefill(n, tokens)
                rows.append({"prompts": n, "tokens": tokens, "round": r, "layers": name, "seconds": dt,
                             "prefill_tok_s": n * tokens / dt})
                print(json.dumps(rows[-1]), flush=True)
    runner.cpu_decode = cpp
    for n, tokens in cases:
        best = {k: max(x["prefill_tok_s"] for x in rows if x["tokens"] == tokens and x["prompts"] == n
                       and x["layers"] == k) for k in ("python", "c++")}
        print(f"{n} x {tokens}: python {best['python']:.0f} tok/s, c++ {best['c++']:.0f} tok/s, "
              f"{best['c++'] / best['python']:.2f}x (best of {rounds})")


# -- --transformers ---------------------------------------------------------------------------------

class PeakMemory:
    """Peak RSS of this process (sampled) during a `with` block; on CUDA, peak allocated bytes."""

    def __init__(self, device: torch.device):
        self.device, self.peak, self._stop = device, 0, threading.Event()

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _watch(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss())

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak = self._rss()
            self._t = threading.Thread(target=self._watch, daemon=True)
            self._t.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._t.join()
            self.peak = max(self.peak, self._rss())


def text_workload(tokenizer, n: int, seed: int = 0, min_in: int = 32, max_in: int = 256, min_out: int = 16,
                  max_out: int = 256):
    """n prompts of min_in-max_in tokens cut from WikiText-2 test, each with max_tokens from min_out-max_out."""
    rng = random.Random(seed)
    ids = tokenizer(WIKITEXT.read_text(encoding="utf-8")[:400_000]).input_ids
    prompts, outs = [], []
    for _ in range(n):
        length = rng.randint(min_in, max_in)
        start = rng.randrange(0, len(ids) - length)
        prompts.append(ids[start:start + length])
        outs.append(rng.randint(min_out, max_out))
    return prompts, outs


def _timed_peak(device, fn):
    with PeakMemory(device) as mem:
        t = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t
    return out, dt, mem.peak


def bench_transformers(model: str | None, num_prompts: int, hf_batch: int, single_prompts: int | None) -> None:
    """The engine's offline throughput against transformers `generate`, batched and one at a time."""
    from transformers import AutoModelForCausalLM   # deferred: only this mode needs transformers' models
    torch.manual_seed(0)
    loaded = load_model(model, "float32", "auto")
    dev = loaded.device
    prompts, outs = text_workload(loaded.tokenizer, num_prompts)
    print(f"workload: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {sum(outs)} output tokens, "
          f"torch threads {torch.get_num_threads()}, device {dev}", flush=True)
    llm = LLM(loaded=loaded, kv_cache_memory=768 << 20, max_model_len=1024, max_num_seqs=256,
              max_num_batched_tokens=2048, block_size=16, seed=0)
    llm.generate(prompts[:2], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 2)  # warm-up
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outs]
    res, dt, peak = _timed_peak(dev, lambda: llm.generate(prompts, params))
    ours = [r.outputs[0].token_ids for r in res]
    assert sum(map(len, ours)) == sum(outs)
    tps = sum(outs) / dt
    rows = [("llmopt engine", tps, dt, peak)]
    print(f"llmopt engine:            {tps:8.1f} tok/s  {dt:7.1f} s  peak {peak / 2**20:7.0f} MiB", flush=True)
    with tempfile.TemporaryDirectory() as tmp:   # a GGUF's float copy for transformers
        hf = AutoModelForCausalLM.from_pretrained(hf_folder(model, tmp), dtype=torch.float32).to(dev).eval()
    _, b_dt, b_peak = _timed_peak(dev, lambda: hf_generate_left_padded(hf, prompts, outs, dev, hf_batch))
    rows.append((f"transformers batched-{hf_batch}", sum(outs) / b_dt, b_dt, b_peak))
    print(f"transformers batched-{hf_batch}:  {rows[-1][1]:8.1f} tok/s  {b_dt:7.1f} s  peak {b_peak / 2**20:7.0f} MiB",
          flush=True)
    k = single_prompts or len(prompts)
    theirs, a_dt, a_peak = _timed_peak(dev, lambda: hf_generate_single(hf, prompts[:k], outs[:k], dev))
    same = sum(x == y for x, y in zip(ours, theirs))
    name = "transformers one-at-a-time" + (f" (first {k} prompts)" if k < len(prompts) else "")
    rows.append((name, sum(outs[:k]) / a_dt, a_dt, a_peak))
    print(f"{name}: {rows[-1][1]:6.1f} tok/s  {a_dt:7.1f} s  peak {a_peak / 2**20:7.0f} MiB  "
          f"({same}/{k} outputs token-identical to the engine's)", flush=True)
    print("\n| system | output tok/s | wall s | peak memory MiB | engine speed-up |")
    print("|---|---:|---:|---:|---:|")
    for name, t, d, p in rows:
        print(f"| {name} | {t:.1f} | {d:.1f} | {p / 2**20:.0f} | {tps / t:.2f}x |")


def bench_configs(a) -> None:
    """The decode figures of each --config (and llama.cpp with --llamacpp), as JSON lines and a summary."""
    batches = [b for b in (a.batch if a.batch is not None else [16, 64]) if b > 0]
    extra = {}
    for kv in a.engine_arg:
        k, _, v = kv.partition("=")
        extra[k] = {"true": True, "false": False}.get(v.lower(), v)
    results = []
    runs = [(c, kv) for c in a.config or ["float32"] for kv in a.kv_cache_dtype or [None]]
    for cfg, kv in runs:
        cfg, compiled = (cfg[:-len("@compiled")], True) if cfg.endswith("@compiled") else (cfg, False)
        kw = {**extra, "enforce_eager": False} if compiled else dict(extra)
        if kv is not None:
            kw["kv_cache_dtype"] = kv
        name, _, path = cfg.partition("=")
        label = name + (" compiled" if compiled else "") + (f" kv={kv}" if kv is not None else "")
        if path:
            results.append(bench_llmopt(label, path, None, a.single, batches, a.gen_batched, kw))
        elif name == "float32":
            results.append(bench_llmopt(label, a.model, None, a.single, batches, a.gen_batched, kw))
        else:
            results.append(bench_llmopt(label, a.model, name, a.single, batches, a.gen_batched, kw))
    if a.llamacpp:
        gguf = Path(a.model) if a.model and a.model.endswith(".gguf") else builtin_gguf(defaults.DEFAULT_MODEL)
        results.append(bench_llamacpp(Path(a.llamacpp_python), gguf, a.single or 256, os.cpu_count() or 2))
    summary = {"load_after": os.getloadavg(), "results": results}
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the built-in smollm2-135m)")
    ap.add_argument("--config", action="append", default=[],
                    help="float32 | int8 | fp8 | NAME=CHECKPOINT (a quantized folder), each with an optional "
                    "@compiled suffix (the compiled decode step: enforce_eager=False); repeatable")
    ap.add_argument("--single", type=int, default=256, help="tokens generated single-stream (0: skip)")
    ap.add_argument("--batch", type=int, action="append", default=None, help="batched sizes (default 16, 64)")
    ap.add_argument("--gen-batched", type=int, default=256, help="tokens generated per sequence when batched")
    ap.add_argument("--llamacpp", action="store_true", help="also llama.cpp on the model's Q4_1 GGUF")
    ap.add_argument("--llamacpp-python", default=str(ROOT / ".venv-llamacpp" / "bin" / "python"))
    ap.add_argument("--engine-arg", action="append", default=[], help="KEY=VALUE passed to EngineArgs")
    ap.add_argument("--kv-cache-dtype", action="append", default=[],
                    help="run every --config once with each of these KV-cache dtypes, in order; repeatable")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--prefill", default=None, metavar="CASES",
                    help="instead: prefill of the C++ against the Python layers, comma-separated PROMPTSxTOKENS")
    ap.add_argument("--rounds", type=int, default=2, help="--prefill: rounds per case")
    ap.add_argument("--transformers", action="store_true",
                    help="instead: the engine's offline throughput against transformers generate")
    ap.add_argument("--num-prompts", type=int, default=64, help="--transformers: prompts")
    ap.add_argument("--hf-batch", type=int, default=16, help="--transformers: transformers' batch")
    ap.add_argument("--single-prompts", type=int, default=None,
                    help="--transformers: run the one-at-a-time peer, the slowest phase, on only the first N prompts")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(json.dumps({"llmopt": str(Path(llmopt.__file__).parent), "load": os.getloadavg()}), flush=True)
    if a.prefill:
        bench_prefill(a.model, a.prefill, a.rounds)
    elif a.transformers:
        bench_transformers(a.model, a.num_prompts, a.hf_batch, a.single_prompts)
    else:
        bench_configs(a)


if __name__ == "__main__":
    main()
