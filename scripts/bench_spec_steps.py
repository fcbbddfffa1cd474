"""Step costs of speculative decoding at batch 1, plain decoding in the same process: the target's
forward over 1 row (a decode step) and over K + 1 rows (verification), the drafter's proposal per
step, and the whole engine step, each the median over a generation; then the acceptance length a
speedup needs: speedup = tau x T_step(plain) / T_step(spec), so tau >= target x the step ratio.

    python scripts/bench_spec_steps.py --spec-model out/smollm2-eagle3-mix/head --method eagle3 --k 1,2,3
    python scripts/bench_spec_steps.py --model out/smollm2-135m-awq-w4g64 --spec-model ... --method eagle3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))   # bench_decode.make_engine


def timed(obj, name: str, log: list) -> None:
    """Wrap obj.name to append (seconds, call result) to log."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        log.append((time.perf_counter() - t, a))
        return out
    setattr(obj, name, wrapper)


def measure(model: str | None, spec: dict | None, prompt: list[int], gen: int) -> dict:
    from bench_decode import make_engine
    from llmopt.engine.sampling_params import SamplingParams
    extra = {"max_model_len": len(prompt) + gen + 16}
    if spec is not None:
        extra["speculative_config"] = spec
    engine = make_engine(model, None, 1, extra)
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    engine.add_request("warm", prompt[:64], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    fwd, prop, steps = [], [], []
    timed(engine.runner, "execute", fwd)
    if spec is not None:
        timed(engine, "_propose_drafts", prop)
    engine.add_request("r", prompt, params)
    engine.step()                       # the prefill
    fwd.clear()
    prop.clear()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    rows: dict[int, list[float]] = {}
    for dt, (sched,) in fwd:
        rows.setdefault(sum(len(s.token_ids) for s in sched.scheduled), []).append(dt)
    st = engine.stats().spec_decoding if spec is not None else None
    return {"step_ms": 1000 * statistics.median(steps), "steps": len(steps),
            "forward_ms": {n: round(1000 * statistics.median(v), 2) for n, v in sorted(rows.items())},
            "forwards": {n: len(v) for n, v in sorted(rows.items())},
            "propose_ms": round(1000 * statistics.median(dt for dt, _ in prop), 2) if prop else None,
            "acceptance_length": None if st is None or not st.num_drafts else
            1 + st.num_accepted_tokens / st.num_drafts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target checkpoint (default: the built-in smollm2-135m)")
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--spec-model", default=None, help="draft model / EAGLE head folder")
    ap.add_argument("--k", default="1,2,3", help="num_speculative_tokens values, comma-separated")
    ap.add_argument("--context", type=int, default=700, help="prompt tokens (random ids)")
    ap.add_argument("--gen", type=int, default=96, help="tokens generated per measurement")
    ap.add_argument("--target", type=float, default=1.5, help="the speedup the tau column is computed for")
    args = ap.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(100, 30000) for _ in range(args.context)]
    plain = measure(args.model, None, prompt, args.gen)
    print(json.dumps({"k": 0, **plain}), flush=True)
    for k in (int(x) for x in args.k.split(",")):
        spec = {"method": args.method, "num_speculative_tokens": k}
        if args.spec_model:
            spec["model"] = args.spec_model
        r = measure(args.model, spec, prompt, args.gen)
        ratio = r["step_ms"] / plain["step_ms"]
        r.update(step_ratio=round(ratio, 3), tau_needed=round(args.target * ratio, 3))
        print(json.dumps({"k": k, **r}), flush=True)


if __name__ == "__main__":
    main()
