"""A scripted OpenAI-compatible server for the bench tests: streams tokens with known delays and
records its own timestamps, so the client's measurements can be checked against the server's.

It runs uvicorn (Starlette) in a subprocess on a free port (its own interpreter: no lock shared
with the client under test); the test reads its records from GET /_records. Each streamed request
waits `ttft` seconds, then sends its tokens `gaps` apart (cycled), one SSE chunk per token, then a
usage chunk and [DONE]. The prompt picks a behaviour: "fail500" (an HTTP 500 with OpenAI's error
body), "hang" (no answer for a minute: a client timeout), "midstream" (two tokens then an error
chunk), "drop" (two tokens then the connection ends without [DONE]); anything else is answered.
`/metrics` serves Prometheus text with prefix-cache counters (each request adds its prompt length
to the queries and half of it to the hits) and a KV-usage gauge (requests in flight / 10).
Also a real `llmopt serve` subprocess for the tests that need the engine (start_llmopt_serve)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from llmopt.ports import free_port
from llmopt.serve.launch import serving


@dataclass
class ServerRecord:
    """One request as the server saw it (time.perf_counter() seconds)."""
    prompt: str
    received: float
    token_times: list[float] = field(default_factory=list)
    status: int = 200

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.received

    @property
    def e2el(self) -> float:
        return self.token_times[-1] - self.received

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None


class ScriptedServer:
    def __init__(self, port: int, ttft: float, gaps: tuple[float, ...], model: str = "scripted",
                 api_key: str | None = None) -> None:
        self.ttft, self.gaps, self.model, self.api_key = ttft, gaps, model, api_key
        self.records: list[ServerRecord] = []
        self.active = 0
        self.max_active = 0
        self.queries = 0
        self.hits = 0
        self.lock = threading.Lock()
        self.port = port

    def reset(self) -> None:
        with self.lock:
            self.records.clear()
            self.max_active = 0

    # -- the app --------------------------------------------------------------------------------------
    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from starlette.routing import Route

        server = self

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": server.model, "object": "model",
                                                             "root": server.model}]})

        async def metrics(request):
            text = (
                "# TYPE scripted:prefix_cache_queries counter\n"
                f'scripted:prefix_cache_queries_total{{model_name="{server.model}"}} {float(server.queries)}\n'
                "# TYPE scripted:prefix_cache_hits counter\n"
                f'scripted:prefix_cache_hits_total{{model_name="{server.model}"}} {float(server.hits)}\n'
                "# TYPE scripted:kv_cache_usage_perc gauge\n"
                f'scripted:kv_cache_usage_perc{{model_name="{server.model}"}} {server.active / 10}\n')
            return PlainTextResponse(text)

        async def completions(request):
            received = time.perf_counter()
            if server.api_key and request.headers.get("authorization") != f"Bearer {server.api_key}":
                return JSONResponse({"error": {"message": "bad key", "type": "auth", "code": 401}}, status_code=401)
            body = await request.json()
            chat = "messages" in body
            prompt = body["messages"][-1]["content"] if chat else body["prompt"]
            n = body.get("max_completion_tokens") if chat else body.get("max_tokens")
            rec = ServerRecord(prompt, received)
            with server.lock:
                server.records.append(rec)
                server.queries += len(prompt.split())
                server.hits += len(prompt.split()) // 2
            if prompt.startswith("fail500"):
                rec.status = 500
                return JSONResponse({"error": {"message": "scripted failure", "type": "InternalServerError",
                                               "code": 500}}, status_code=500)

            def chunk(text: str, finish: str | None) -> str:
                if chat:
                    choice = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": text, "finish_reason": finish}
                return "data: " + json.dumps({"id": "x", "object": "chunk", "model": server.model,
                                              "choices": [choice]}) + "\n\n"

            async def events():
                with server.lock:
                    server.active += 1
                    server.max_active = max(server.max_active, server.active)
                try:
                    if chat:   # the role chunk first, as servers send it: not a token
                        yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                      "content": ""}}]}) + "\n\n"
                    if prompt.startswith("hang"):
                        await asyncio.sleep(60)
                    await asyncio.sleep(server.ttft)
                    count = 2 if prompt.startswith(("midstream", "drop")) else n
                    for i in range(count):
                        if i:
                            await asyncio.sleep(server.gaps[(i - 1) % len(server.gaps)])
                        rec.token_times.append(time.perf_counter())
                        yield chunk(f"t{i} ", "length" if i == n - 1 else None)
                    if prompt.startswith("midstream"):
                        yield "data: " + json.dumps({"error": {"message": "scripted stream error", "code": 500}}) \
                            + "\n\n"
                        return
                    if prompt.startswith("drop"):
                        return
                    yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": len(prompt.split()),
                                                                          "completion_tokens": count,
                                                                          "total_tokens": count}}) + "\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    with server.lock:
                        server.active -= 1

            return StreamingResponse(events(), media_type="text/event-stream")

        async def records(request):
            with server.lock:
                return JSONResponse({"records": [r.__dict__ for r in server.records], "max_active": server.max_active})

        async def reset(request):
            server.reset()
            return JSONResponse({})

        return Starlette(routes=[Route("/v1/models", models), Route("/metrics", metrics),
                                 Route("/_records", records), Route("/_reset", reset, methods=["POST"]),
                                 Route("/v1/completions", completions, methods=["POST"]),
                                 Route("/v1/chat/completions", completions, methods=["POST"])])

    # -- running ------------------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        import uvicorn
        uvicorn.run(self.app(), host="127.0.0.1", port=self.port, log_level="warning")


class ScriptedServerProcess:
    """The test side: starts `python bench_util.py` and reads what the server recorded."""

    def __init__(self, ttft: float = 0.15, gaps: tuple[float, ...] = (0.05, 0.07), model: str = "scripted",
                 api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, str(Path(__file__).resolve()), "--port", str(self.port), "--ttft", str(ttft),
                     "--gaps", ",".join(map(str, gaps)), "--model", model] + (["--api-key", api_key] if api_key else [])
        self.proc = None

    def __enter__(self) -> "ScriptedServerProcess":
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the scripted server exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/_records", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the scripted server did not start")
            time.sleep(0.05)
        for path in ("/v1/completions", "/v1/chat/completions"):   # the server's first requests are slow: not ours
            httpx.post(self.url + path, json={"prompt": "warm", "messages": [{"role": "user", "content": "warm"}],
                                              "max_tokens": 2, "max_completion_tokens": 2}, timeout=30)
        httpx.get(self.url + "/metrics", timeout=10)
        self.reset()
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def reset(self) -> None:
        httpx.post(self.url + "/_reset", timeout=10)

    def state(self) -> tuple[list[ServerRecord], int]:
        """The requests it saw (in arrival order) and the most it had in flight at once."""
        d = httpx.get(self.url + "/_records", timeout=10).json()
        return [ServerRecord(**r) for r in d["records"]], d["max_active"]


# -- a real `llmopt serve` --------------------------------------------------------------------------------
SERVE_ARGS = ["--max-model-len", "256", "--kv-cache-memory-bytes", "16MiB", "--block-size", "16",
              "--max-num-seqs", "32"]


def start_llmopt_serve(model: Path, log: Path, name: str = "tiny"):
    """Yields the base URL of `llmopt serve` on `model` (a subprocess) until the generator is closed."""
    repo = Path(__file__).resolve().parents[2]
    with serving(["--model", str(model), "--served-model-name", name, *SERVE_ARGS, "--uvicorn-log-level", "warning"],
                 log=log, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}, cwd=repo) as server:
        yield server.url


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ttft", type=float, required=True)
    ap.add_argument("--gaps", required=True)
    ap.add_argument("--model", default="scripted")
    ap.add_argument("--api-key", default=None)
    a = ap.parse_args()
    ScriptedServer(a.port, a.ttft, tuple(float(x) for x in a.gaps.split(",")), a.model, a.api_key).serve_forever()
