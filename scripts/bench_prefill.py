"""Prefill speed on the CPU: the C++ layers (one row per prompt token) against the Python layers,
alternating in one process, for prompts of a few lengths (random tokens, one output token each).

    python scripts/bench_prefill.py                       # float32, the default model
    python scripts/bench_prefill.py --model out/smollm2-135m-awq-w4g64
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))   # bench_decode.make_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the built-in smollm2-135m)")
    ap.add_argument("--cases", default="8x256,8x730,1x2000,1x4000", help="comma-separated PROMPTSxTOKENS")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from bench_decode import make_engine
    from llmopt.engine.sampling_params import SamplingParams
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    engine = make_engine(args.model, None, max(n for n, _ in cases), {"max_model_len": max(t for _, t in cases) + 8})
    runner, rng = engine.runner, random.Random(0)
    cpp = runner.cpu_decode
    if cpp is None:
        sys.exit("the C++ layers do not apply to this model here")

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
        for r in range(args.rounds):
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
              f"{best['c++'] / best['python']:.2f}x (best of {args.rounds})")


if __name__ == "__main__":
    main()
