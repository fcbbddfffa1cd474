"""The serving table of docs/benchmarks.md: `llmopt bench` online (against `llmopt serve`) and offline
(the engine in-process) on the default model at several concurrencies, the same workload and engine
settings in both, then a plot and a markdown table.

    python scripts/bench_serving.py                     # concurrency 1, 4, 16; random 128 in / 64 out
    python scripts/bench_serving.py --concurrency 1,4 --repeats 1 --out /tmp/serving

Each (concurrency, mode) is measured --repeats times, online and offline alternating (the order
flipped every repeat), and the table gives the median run by output throughput, with the range: on a
shared machine the load of other jobs moves every number, and alternating makes the drift hit both
modes alike. One run is what these commands print (PORT: the server's; N = max(C, 2) requests;
OMP_NUM_THREADS=1 for both, the README's advice on a busy 2-core machine):

    llmopt serve --port PORT
    llmopt bench --base-url http://127.0.0.1:PORT --random-input-len 128 --random-output-len 64 \\
        --ignore-eos --max-concurrency C --num-prompts N --num-warmups 1
    llmopt bench --random-input-len 128 --random-output-len 64 --ignore-eos --max-concurrency C \\
        --num-prompts N --num-warmups 1

(the script runs the same library calls in one process, so the model loads once.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server and the offline engine")
    ap.add_argument("--out", default="docs/bench-serving", help="writes OUT.json and OUT.png")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    from llmopt.bench.config import BenchConfig, SamplingSpec
    from llmopt.bench.datasets import Workload, sample_requests
    from llmopt.bench.offline import build_engine, run_engine
    from llmopt.bench.online import resolve_target, run_online
    from llmopt.bench.runner import result_of
    from llmopt.bench.schedule import Load
    from llmopt.engine.args import EngineArgs
    from llmopt.ports import free_port
    from llmopt.serve.launch import serve_command, stop, wait_ready

    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.concurrency.split(",")]
    load_before = loadavg()
    t0 = time.monotonic()

    port = free_port()
    log_path = REPO / f".bench-serve-{port}.log"
    log = open(log_path, "wb")
    server = subprocess.Popen(serve_command(["--uvicorn-log-level", "warning"], port), stdout=log,
                              stderr=subprocess.STDOUT, cwd=REPO,
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    url = f"http://127.0.0.1:{port}"
    runs: dict[str, dict[int, list[dict]]] = {"online": {c: [] for c in levels}, "offline": {c: [] for c in levels}}
    try:
        engine = build_engine(BenchConfig(engine_args=EngineArgs()))
        wait_ready(server, url, 300, log_path)   # the server loaded its model while the engine here loaded
        for c in levels:
            n = max(c, 2)
            workload = Workload("random", num_prompts=n, random_input_len=args.input_len,
                                    random_output_len=args.output_len)
            common = dict(workload=workload, load=Load(max_concurrency=c), sampling=SamplingSpec(ignore_eos=True),
                          num_warmups=1)
            online_cfg = BenchConfig(base_url=url, **common)
            offline_cfg = BenchConfig(engine_args=engine.args, **common)
            target = resolve_target(online_cfg)
            requests = sample_requests(workload, engine.tokenizer)
            for rep in range(args.repeats):
                order = ("online", "offline") if rep % 2 == 0 else ("offline", "online")
                for mode in order:
                    if mode == "online":
                        cfg, out = online_cfg, run_online(online_cfg, target, requests, online_cfg.load)
                    else:
                        cfg, out = offline_cfg, run_engine(engine, offline_cfg, requests, offline_cfg.load)
                    d = result_of(cfg, out, cfg.load, engine.tokenizer, "smollm2-135m", "smollm2-135m").to_dict()
                    runs[mode][c].append(d)
                    print(f"c={c} {mode:7s} repeat {rep}: {d['output_throughput']:.1f} tok/s, "
                          f"TPOT {d['mean_tpot_ms']:.0f} ms, load {loadavg()}", file=sys.stderr)
    finally:
        stop(server, grace=60)
        log.close()
        log_path.unlink(missing_ok=True)
    load_after = loadavg()
    minutes = (time.monotonic() - t0) / 60

    def median_run(rs: list[dict]) -> dict:
        return sorted(rs, key=lambda r: r["output_throughput"])[len(rs) // 2]

    keep = ("num_prompts", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
            "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms",
            "p99_itl_ms", "mean_e2el_ms", "kv_cache_usage_max", "prefix_cache_hit_rate")
    summary = {"threads": args.threads, "repeats": args.repeats, "load_average_before": load_before,
               "load_average_after": load_after, "minutes": round(minutes, 1),
               "workload": f"random {args.input_len} in / {args.output_len} out, --ignore-eos",
               "runs": {mode: {str(c): [{k: r[k] for k in keep} for r in rs] for c, rs in by_c.items()}
                        for mode, by_c in runs.items()}}
    Path(args.out + ".json").write_text(json.dumps(summary, indent=1) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for mode, style in (("online", "o-"), ("offline", "s--")):
        med = [median_run(runs[mode][c]) for c in levels]
        lo = [min(r["output_throughput"] for r in runs[mode][c]) for c in levels]
        hi = [max(r["output_throughput"] for r in runs[mode][c]) for c in levels]
        ys = [m["output_throughput"] for m in med]
        axes[0].errorbar(levels, ys, yerr=[[y - a for y, a in zip(ys, lo)], [b - y for y, b in zip(ys, hi)]],
                         fmt=style, capsize=3, label=mode)
        axes[1].plot(levels, [m["mean_ttft_ms"] for m in med], style, label=mode)
        axes[2].plot(levels, [m["mean_tpot_ms"] for m in med], style, label=mode)
    for ax, title in zip(axes, ("output tokens/s (median, range)", "mean TTFT (ms)", "mean TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("max concurrency")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M on the 2-core CPU, random {args.input_len} in / {args.output_len} out, "
                 f"{args.threads} thread(s); load average {load_before} (a shared, busy machine)", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=65)

    print(f"load average before: {load_before}; after: {load_after}; {minutes:.1f} minutes")
    print("| concurrency | requests | mode | output tok/s (median, range) | req/s | total tok/s | mean TTFT ms "
          "| mean TPOT ms | mean ITL ms | mean E2EL ms |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for c in levels:
        meds = {}
        for mode in ("offline", "online"):
            rs = runs[mode][c]
            r = meds[mode] = median_run(rs)
            lo, hi = min(x["output_throughput"] for x in rs), max(x["output_throughput"] for x in rs)
            print(f"| {c} | {r['completed']} | {mode} | **{r['output_throughput']:.1f}** ({lo:.1f}-{hi:.1f}) "
                  f"| {r['request_throughput']:.3f} | {r['total_token_throughput']:.1f} | {r['mean_ttft_ms']:.0f} "
                  f"| {r['mean_tpot_ms']:.1f} | {r['mean_itl_ms']:.1f} | {r['mean_e2el_ms']:.0f} |")
        on, off = meds["online"], meds["offline"]
        print(f"| {c} | | online − offline | {100 * (on['output_throughput'] / off['output_throughput'] - 1):+.1f}% "
              f"| | | {on['mean_ttft_ms'] - off['mean_ttft_ms']:+.0f} "
              f"| {on['mean_tpot_ms'] - off['mean_tpot_ms']:+.1f} "
              f"| {on['mean_itl_ms'] - off['mean_itl_ms']:+.1f} "
              f"| {on['mean_e2el_ms'] - off['mean_e2el_ms']:+.0f} |")


if __name__ == "__main__":
    main()
