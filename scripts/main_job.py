"""The main job (`make run`): walk the default model through the toolkit and print one summary.

eval-ppl (base) -> quantize (AWQ w4 g64) -> eval-ppl (quantized, KL against base) -> kv-estimate
-> generate (a chat prompt through the paged-KV engine on the quantized model) -> serve (the same
checkpoint behind `llmopt serve` on a free port, asked one chat completion over HTTP and measured
by a short `llmopt bench` (8 requests, concurrency 4), then stopped with SIGTERM, which must exit 0).
One stream is benched offline (the engine in-process) and through the server, and the second run
compares itself with the first (`--compare-to`): serving more than 25% below the engine's tokens/s
or time per output token is flagged in the summary and exits 4. Each step is the real CLI with
--json; progress bars go to stderr. Exits non-zero on the first failing step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx

from llmopt.errors import LLMOptError
from llmopt.ports import free_port
from llmopt.serve.launch import launch, serve_command, stop

ROOT = Path(__file__).resolve().parents[1]
EVAL = ["--method", "chunks", "--ctx", "2048", "--dataset", "../shared/data/wikitext-2-raw/wiki.test.raw"]
# the engine configuration the generate step runs; kv-estimate plans exactly this one
ENGINE = ["--device", "auto", "--dtype", "auto", "--kv-cache-dtype", "auto", "--block-size", "16",
          "--kv-cache-memory", "1GiB", "--max-model-len", "8192"]


# one stream, offline and through the server: `--compare-to` fails (exit 4) when serving costs more
# than SERVE_GAP_PCT of the engine's tokens/s or time per output token
ONE_STREAM = ["--num-prompts", "4", "--max-concurrency", "1", "--random-input-len", "64", "--random-output-len", "64",
              "--ignore-eos", "--num-warmups", "1", "--seed", "1", "--quiet"]   # seed 1: not the c=4 prompts
SERVE_GAP_PCT = 25


def llmopt(*args: str, ok: tuple[int, ...] = (0,)) -> tuple[dict, float]:
    """Run one `llmopt ... --json` command; return its JSON object and wall time (exit codes other
    than `ok` end the main job)."""
    cmd = [sys.executable, "-m", "llmopt", *args, "--json"]
    print(f"$ llmopt {' '.join(args)} --json", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if proc.returncode not in ok:
        sys.exit(f"main job: `llmopt {args[0]}` failed with exit code {proc.returncode}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return json.loads(lines[-1]), time.perf_counter() - t0


def serve_and_query(model: str, question: str, offline: Path, max_tokens: int = 48) -> tuple[dict, float]:
    """Start `llmopt serve` on `model` (the ENGINE flags) on a free port, ask one chat completion
    over HTTP, bench it (concurrency 4, then one stream against the `offline` result), stop it with
    SIGTERM; returns the answer and the server's timings."""
    port = free_port()
    args = ["--model", model, *ENGINE, "--served-model-name", "main-job", "--uvicorn-log-level", "warning",
            "--log-interval", "0"]
    print(f"$ llmopt serve {' '.join(args)} --port {port}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        server = launch(serve_command(args, port), f"http://127.0.0.1:{port}", port, cwd=ROOT, timeout=600)
    except LLMOptError as e:
        sys.exit(f"main job: `llmopt serve` did not come up: {e}")
    try:
        body = {"model": "main-job", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                "temperature": 0}
        t1 = time.perf_counter()
        answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=600).raise_for_status().json()
        query = time.perf_counter() - t1
        bench, _ = llmopt("bench", "--base-url", server.url, "--model", "main-job", "--tokenizer", model,
                          "--num-prompts", "8", "--max-concurrency", "4", "--random-input-len", "64",
                          "--random-output-len", "16", "--ignore-eos", "--quiet")
        one, _ = llmopt("bench", "--base-url", server.url, "--model", "main-job", "--tokenizer", model, *ONE_STREAM,
                        "--compare-to", str(offline), "--compare-metrics", "output_throughput,mean_tpot_ms",
                        "--fail-threshold", str(SERVE_GAP_PCT), ok=(0, 4))
    finally:
        code = stop(server.proc, grace=60)
    if code != 0:
        sys.exit(f"main job: `llmopt serve` exited with code {code} after SIGTERM (expected 0)")
    return {"text": answer["choices"][0]["message"]["content"], "usage": answer["usage"],
            "seconds_to_ready": server.seconds_to_ready, "seconds_query": query,
            "bench": {k: bench[k] for k in ("completed", "failed", "output_throughput", "mean_ttft_ms", "mean_tpot_ms")},
            "one_stream": {k: one[k] for k in ("output_throughput", "mean_tpot_ms", "server_mean_tpot_ms", "comparison")}
            }, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=16384, help="WikiText-2 test tokens scored (default 16,384)")
    ap.add_argument("--num-samples", type=int, default=32, help="AWQ calibration windows of 512 tokens (default 32)")
    ap.add_argument("--out", default="out/smollm2-135m-awq-w4g64", help="quantized checkpoint folder")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    a = ap.parse_args()
    limit = ["--limit", str(a.limit)]

    base, t_base = llmopt("eval-ppl", *EVAL, *limit)
    quant, t_quant = llmopt("quantize", "--method", "awq", "--bits", "4", "--group-size", "64",
                            "--num-samples", str(a.num_samples), "--output", a.out, "--overwrite")
    after, t_after = llmopt("eval-ppl", "--model", a.out, "--base-model", "smollm2-135m", *EVAL, *limit)
    kv, _ = llmopt("kv-estimate", "--model", a.out, *ENGINE)
    gen, t_gen = llmopt("generate", "--model", a.out, *ENGINE, "--chat", "What is the capital of France?",
                        "--max-tokens", "48")
    with tempfile.TemporaryDirectory(prefix="llmopt-main-job-") as tmp:
        offline_json = Path(tmp) / "offline.json"
        offline, _ = llmopt("bench", "--model", a.out, *ENGINE, *ONE_STREAM, "--output", str(offline_json))
        served, t_serve = serve_and_query(a.out, "What is the capital of France?", offline_json)
    served["one_stream"]["offline_output_throughput"] = offline["output_throughput"]
    served["one_stream"]["offline_mean_tpot_ms"] = offline["mean_tpot_ms"]
    regressed = [d["metric"] for d in served["one_stream"]["comparison"]["deltas"] if d["regressed"]]

    summary = {"base": base, "quantize": quant, "quantized": after, "kv_estimate": kv, "generate": gen,
               "serve": served, "seconds": {"eval_base": t_base, "quantize": t_quant, "eval_quantized": t_after,
                                            "generate": t_gen, "serve": t_serve}}
    if a.json:
        print(json.dumps(summary))
        sys.exit(4 if regressed else 0)
    t = Table("llmopt main job: SmolLM2-135M-Instruct, AWQ w4 g64")
    t.add_row("eval-ppl base", f"ppl {base['ppl']:.4f} over {base['scored_tokens']:,} tokens", f"{t_base:.0f} s")
    t.add_row("quantize awq", _quant_line(quant), f"{t_quant:.0f} s")
    kl = after.get("kl") or {}
    t.add_row("eval-ppl awq", f"ppl {after['ppl']:.4f} ({after['ppl'] / base['ppl'] - 1:+.2%}); "
              f"KLD mean {kl.get('kld_mean', float('nan')):.4f}, top-1 agreement {kl.get('top1_agreement', float('nan')):.2%}",
              f"{t_after:.0f} s")
    t.add_row("kv-estimate", _kv_line(kv), "")
    t.add_row("generate", repr(gen["text"][:120]), f"{t_gen:.0f} s")
    t.add_row("serve", f"{served['text'][:120]!r} (HTTP chat completion, {served['usage']['completion_tokens']} "
              f"tokens in {served['seconds_query']:.1f} s; ready after {served['seconds_to_ready']:.0f} s; "
              "SIGTERM: exit 0)", f"{t_serve:.0f} s")
    b = served["bench"]
    t.add_row("bench", f"llmopt bench against the server: {b['completed']} of 8 requests (random 64 in / 16 out, "
              f"concurrency 4), {b['output_throughput']:.1f} output tok/s, mean TTFT {b['mean_ttft_ms']:.0f} ms, "
              f"mean TPOT {b['mean_tpot_ms']:.0f} ms", "")
    o = served["one_stream"]
    verdict = (f"REGRESSED beyond {SERVE_GAP_PCT}%: {', '.join(regressed)}" if regressed
               else f"within {SERVE_GAP_PCT}% (--compare-to)")
    t.add_row("serve vs offline", f"one stream (64 in / 64 out): served {o['output_throughput']:.1f} tok/s against "
              f"the engine offline {o['offline_output_throughput']:.1f} "
              f"({o['output_throughput'] / o['offline_output_throughput']:.2f}x); TPOT {o['mean_tpot_ms']:.1f} ms "
              f"(server's own: {o['server_mean_tpot_ms']:.1f}) against {o['offline_mean_tpot_ms']:.1f}; {verdict}", "")
    t.print()
    if regressed:
        sys.exit(4)


class Table:
    """The summary: a title, then one row a step (step, result, time), the result wrapped to the terminal."""

    def __init__(self, title: str) -> None:
        self.title, self.rows = title, []

    def add_row(self, step: str, result: str, seconds: str) -> None:
        self.rows.append((step, result, seconds))

    def print(self) -> None:
        w0 = max(len(r[0]) for r in self.rows)
        w2 = max(len(r[2]) for r in self.rows)
        width = max(40, shutil.get_terminal_size((120, 24)).columns - w0 - w2 - 4)
        print(self.title)
        for step, result, seconds in self.rows:
            lines = textwrap.wrap(result, width) or [""]
            print(f"{step:<{w0}}  {lines[0]:<{width}}  {seconds:>{w2}}".rstrip())
            for line in lines[1:]:
                print(f"{'':<{w0}}  {line}")


def _quant_line(q: dict) -> str:
    before, after = q["size_before"], q["size_after"]
    return (f"{before / 2**20:,.0f} MiB -> {after / 2**20:,.0f} MiB ({before / after:.1f}x smaller), "
            f"mean layer rel. error {q['mean_rel_error']:.4f}")


def _kv_line(kv: dict) -> str:
    paged = kv["paged"]
    return (f"{kv['bytes_per_token']:,} KV bytes/token ({kv['kv_cache_dtype']}, model {kv['dtype']} on "
            f"{kv['device']}); 1 GiB holds "
            f"{paged['num_blocks']:,} blocks = {paged['tokens']:,} tokens, "
            f"{paged['max_concurrency']:.1f} requests of {kv['max_model_len']:,} tokens")


if __name__ == "__main__":
    main()
