"""`llmopt serve` against llama.cpp's `llama-server` on the default model, in one run, with the
engine's offline figure beside both: the serving table of docs/benchmarks.md.

The workload (the same prompts for every system): at each --concurrency, --num-prompts prompts of
40-120 words cut from WikiText-2 raw test (a seed per level, so no level reuses another's prompts
from a prefix cache), --output-len tokens each with ignore_eos, greedy, streamed, one warm-up
request. Systems, each alone on the machine (started, benchmarked,
stopped before the next starts):

- `llama-server` on the built-in Q4_1 GGUF (`-np` = the highest concurrency, `-t` = --threads;
  scripts/peer_llamacpp.sh tools builds it into .venv-llamacpp/bin);
- `llmopt serve` on --llmopt-model (default out/smollm2-awq, the AWQ w4 g64 checkpoint that
  `llmopt quantize --method awq --output out/smollm2-awq` writes) and, with --gguf-too, on the GGUF;
- `llmopt bench --model` offline: the same engine in-process, no HTTP.

Every row is one `llmopt bench` command (printed as it runs); the ratios are llmopt's output
tokens/s over llama-server's, and serve's over offline at the same concurrency. With --rounds N the
systems run N times, one after the other in turn, and each row is the round of median output
tokens/s: on a 2-core machine one round's figure moves by several percent from run to run.

    python scripts/bench_serve_peers.py                                # 1, 8, 32; 64 prompts, 128 out
    python scripts/bench_serve_peers.py --concurrency 1 --num-prompts 16 --systems llmopt,offline --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmopt.models.config import builtin_gguf
from llmopt.ports import free_port
from llmopt.serve.launch import launch, stop

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO / ".." / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
MODEL = "smollm2-135m"
SYSTEMS = ("llama-server", "llmopt", "llmopt-gguf", "offline")


def make_prompts(path: Path, n: int, seed: int) -> None:
    """n prompts of 40-120 consecutive words from WikiText-2's paragraphs, as a prompts .jsonl."""
    words = [w for line in WIKITEXT.read_text(encoding="utf-8").splitlines()
             if len(line.split()) > 120 for w in [line.split()]]
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            para = rng.choice(words)
            k = rng.randint(40, 120)
            start = rng.randint(0, len(para) - k)
            f.write(json.dumps({"prompt": " ".join(para[start:start + k])}) + "\n")


def llama_server_binary(given: str | None) -> str:
    for cand in (given, REPO / ".venv-llamacpp" / "bin" / "llama-server", shutil.which("llama-server")):
        if cand and Path(cand).is_file():
            return str(cand)
    sys.exit("no llama-server: run `scripts/peer_llamacpp.sh tools` (or pass --llama-server PATH)")


def server_command(system: str, port: int, args) -> list[str]:
    if system == "llama-server":
        slots = max(args.levels)
        return [args.llama_server, "-m", str(builtin_gguf(MODEL)), "--host", "127.0.0.1", "--port", str(port),
                "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots),
                "-c", str(slots * args.slot_ctx), "--no-warmup", "-ngl", "0"]
    model = args.llmopt_model if system == "llmopt" else str(builtin_gguf(MODEL))
    return [sys.executable, "-m", "llmopt", "serve", "--model", model, "--port", str(port),
            "--uvicorn-log-level", "warning", "--disable-log-requests", *args.serve_args.split()]


def bench_args(args, c: int) -> list[str]:
    return ["--dataset-name", "prompts", "--dataset-path", str(args.prompts[c]), "--custom-output-len",
            str(args.output_len), "--ignore-eos", "--max-concurrency", str(c), "--num-prompts", str(args.num_prompts),
            "--num-warmups", "1", "--tokenizer", MODEL, "--json"]


def run_bench(cmd: list[str]) -> dict:
    print("$ llmopt " + " ".join(cmd[3:]), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        sys.exit(f"llmopt bench failed ({r.returncode}): {r.stdout[-500:]} {r.stderr[-1500:]}")
    return json.loads(r.stdout)


KEEP = ("completed", "failed", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
        "p99_itl_ms", "server_mean_tpot_ms")


def bench_system(system: str, args) -> dict[int, dict]:
    llmopt = [sys.executable, "-m", "llmopt", "bench"]
    rows: dict[int, dict] = {}
    if system == "offline":
        for c in args.levels:
            d = run_bench(llmopt + ["--model", args.llmopt_model, *bench_args(args, c)])
            rows[c] = {k: d.get(k) for k in KEEP}
        return rows
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = args.log_dir / f"{system}.log"
    server = launch(server_command(system, port, args), url, port, log=log, cwd=REPO, timeout=900,
                    env={"OMP_NUM_THREADS": str(args.threads)})
    try:
        for c in args.levels:
            d = run_bench(llmopt + ["--base-url", url, *bench_args(args, c)])
            rows[c] = {k: d.get(k) for k in KEEP}
    finally:
        stop(server.proc, grace=30)
    return rows


def median_round(rounds: list[dict]) -> dict:
    """The round of median output tokens/s (the lower middle one of an even count)."""
    ranked = sorted(rounds, key=lambda r: r["output_throughput"])
    return ranked[(len(ranked) - 1) // 2]


def table(results: dict[str, dict[int, dict]], levels: list[int]) -> str:
    lines = ["| concurrency | system | output tok/s | vs llama-server | vs offline | median TTFT ms | p99 TTFT ms "
             "| mean TPOT ms (client / server) | p99 ITL ms |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in levels:
        peer = results.get("llama-server", {}).get(c)
        offline = results.get("offline", {}).get(c)
        for system, rows in results.items():
            r = rows.get(c)
            if r is None:
                continue
            ratio = f"{r['output_throughput'] / peer['output_throughput']:.2f}x" if peer else "-"
            vs_offline = (f"{r['output_throughput'] / offline['output_throughput']:.2f}x"
                          if offline and system == "llmopt" else "-")   # the same checkpoint as offline's
            srv = f" / {r['server_mean_tpot_ms']:.1f}" if r.get("server_mean_tpot_ms") else ""
            lines.append(f"| {c} | {system} | **{r['output_throughput']:.1f}** | {ratio} | {vs_offline} "
                         f"| {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {r['mean_tpot_ms']:.1f}{srv} "
                         f"| {r['p99_itl_ms']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="llama-server,llmopt,offline", help=f"of {', '.join(SYSTEMS)}")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--llmopt-model", default="out/smollm2-awq")
    ap.add_argument("--serve-args", default="", help="extra `llmopt serve` flags, e.g. '--max-num-batched-tokens 512'")
    ap.add_argument("--llama-server", default=None, help="the llama-server binary (default: .venv-llamacpp/bin)")
    ap.add_argument("--slot-ctx", type=int, default=512, help="llama-server context per slot (-c = slots x this)")
    ap.add_argument("--rounds", type=int, default=1, help="run the systems this many times in turn; "
                    "each row is the round of median output tokens/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write every row as JSON here")
    args = ap.parse_args()
    args.levels = [int(x) for x in args.concurrency.split(",")]
    systems = [s for s in args.systems.split(",") if s]
    if unknown := set(systems) - set(SYSTEMS):
        sys.exit(f"unknown --systems {', '.join(sorted(unknown))}: choose from {', '.join(SYSTEMS)}")
    if "llama-server" in systems:
        args.llama_server = llama_server_binary(args.llama_server)
    if any(s in systems for s in ("llmopt", "offline")) and not Path(args.llmopt_model).exists():
        sys.exit(f"--llmopt-model {args.llmopt_model} does not exist: run `llmopt quantize --method awq --bits 4 "
                 f"--group-size 64 --output {args.llmopt_model}` first")
    with tempfile.TemporaryDirectory(prefix="llmopt-bench-serve-") as tmp:
        args.log_dir = Path(tmp)
        args.prompts = {c: Path(tmp) / f"prompts-{c}.jsonl" for c in args.levels}
        for c, path in args.prompts.items():
            make_prompts(path, args.num_prompts + 1, args.seed * 1000 + c)   # + the warm-up
        t0 = time.monotonic()
        rounds: dict[str, dict[int, list[dict]]] = {s: {c: [] for c in args.levels} for s in systems}
        for _ in range(args.rounds):
            for s in systems:
                for c, row in bench_system(s, args).items():
                    rounds[s][c].append(row)
    results = {s: {c: median_round(rows) for c, rows in per.items()} for s, per in rounds.items()}
    print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, --threads {args.threads}, "
          f"{args.num_prompts} prompts of 40-120 WikiText-2 words, {args.output_len} tokens out, "
          f"{args.rounds} round(s), {(time.monotonic() - t0) / 60:.1f} minutes")
    print(table(results, args.levels))
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results, "rounds": rounds, "argv": sys.argv[1:]},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
