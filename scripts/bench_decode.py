"""Decode speed on the CPU (issue #14): single-stream decode tokens/s (64-token prompt, 256 generated,
greedy, EOS ignored) and batched output tokens/s (16 and 64 sequences), for llmopt configurations
against llama.cpp (llama-cpp-python from scripts/peer_llamacpp.sh) on the same model's Q4_1 GGUF, in
one run. `--engine-root` runs the llmopt figures with another checkout's code (the parent commit's
worktree), for the batched comparison.

    python scripts/bench_decode.py --config float32 --config int8 --config awq=out/smollm2-awq \\
        --config gptq=out/smollm2-gptq --llamacpp --json out/bench_decode.json
    python scripts/bench_decode.py --engine-root /tmp/parent --config float32 --single 0   # parent: batched only

Timing: single stream, from the first generated token to the last (prefill excluded); batched,
from the start to the last token (prefill included), output tokens over wall time. Speed is
measured here, never asserted in tests. Run it on an idle machine (`uptime`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    import random
    rng = random.Random(seed)
    return [[rng.randrange(100, min(vocab, 30000)) for _ in range(PROMPT_LEN)] for _ in range(n)]


def make_engine(model: str | None, quantization: str | None, max_num_seqs: int, extra: dict):
    from llmopt.engine.engine import LLMEngine
    from llmopt.engine.args import EngineArgs
    kw = dict(model=model, dtype="float32", device="cpu", max_num_seqs=max_num_seqs, detokenize=False,
              max_model_len=1024, enable_prefix_caching=False)
    kw.update(extra)   # --engine-arg (or a caller) may override the defaults above
    if quantization:
        kw["quantization"] = quantization
    return LLMEngine(EngineArgs(**kw))


def run_requests(engine, ps: list[list[int]], gen: int) -> tuple[float, float, int]:
    """(start, first token time, end) and the output tokens; one request per prompt."""
    from llmopt.engine.sampling_params import SamplingParams
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="float checkpoint (default: the built-in smollm2-135m)")
    ap.add_argument("--config", action="append", default=[],
                    help="float32 | int8 | fp8 | NAME=CHECKPOINT (a quantized folder), each with an optional "
                    "@compiled suffix (the compiled decode step: enforce_eager=False); repeatable")
    ap.add_argument("--single", type=int, default=256, help="tokens generated single-stream (0: skip)")
    ap.add_argument("--batch", type=int, action="append", default=None, help="batched sizes (default 16, 64)")
    ap.add_argument("--gen-batched", type=int, default=256, help="tokens generated per sequence when batched")
    ap.add_argument("--llamacpp", action="store_true", help="also llama.cpp on the model's Q4_1 GGUF")
    ap.add_argument("--llamacpp-python", default=str(ROOT / ".venv-llamacpp" / "bin" / "python"))
    ap.add_argument("--engine-root", default=None, help="run the llmopt figures with this checkout's code")
    ap.add_argument("--engine-arg", action="append", default=[], help="KEY=VALUE passed to EngineArgs")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    batches = a.batch if a.batch is not None else [16, 64]
    batches = [b for b in batches if b > 0]
    if a.engine_root:   # the other checkout's llmopt, this script's harness
        sys.path.insert(0, str(Path(a.engine_root).resolve()))
    extra = {}
    for kv in a.engine_arg:
        k, _, v = kv.partition("=")
        extra[k] = {"true": True, "false": False}.get(v.lower(), v)
    import llmopt
    print(json.dumps({"llmopt": str(Path(llmopt.__file__).parent), "load": os.getloadavg()}), flush=True)
    results = []
    for cfg in a.config or ["float32"]:
        cfg, compiled = (cfg[:-len("@compiled")], True) if cfg.endswith("@compiled") else (cfg, False)
        kw = {**extra, "enforce_eager": False} if compiled else extra
        name, _, path = cfg.partition("=")
        label = name + (" compiled" if compiled else "")
        if path:
            results.append(bench_llmopt(label, path, None, a.single, batches, a.gen_batched, kw))
        elif name == "float32":
            results.append(bench_llmopt(label, a.model, None, a.single, batches, a.gen_batched, kw))
        else:
            results.append(bench_llmopt(label, a.model, name, a.single, batches, a.gen_batched, kw))
    if a.llamacpp:
        from llmopt.models.config import builtin_gguf
        from llmopt import defaults
        gguf = Path(a.model) if a.model and a.model.endswith(".gguf") else builtin_gguf(defaults.DEFAULT_MODEL)
        results.append(bench_llamacpp(Path(a.llamacpp_python), gguf, a.single or 256, os.cpu_count() or 2))
    summary = {"load_after": os.getloadavg(), "results": results}
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
