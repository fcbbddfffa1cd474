"""The online benchmark: a streaming client (aiohttp, on uvloop where installed) for any
OpenAI-compatible server.

Each request is one streamed POST to /v1/completions or /v1/chat/completions with
`stream_options.include_usage` (so the server counts the output tokens) and `ignore_eos` when asked;
the client notes when each chunk carrying text arrives (TTFT, ITL), when the last one came (E2EL),
and any failure as a reason (an HTTP status and the server's message, an error inside the stream, a
connection error, a timeout), never raising. Requests go out on the schedule (schedule.py); with
--max-concurrency a due request waits for a free slot. Before and after the run /metrics is read
(counters differenced), and while it runs the KV-usage gauge is sampled every second. The client
opens its connections (one per allowed concurrent request, at most BENCH_PREOPEN_CONNECTIONS)
before the clock starts, as a warm client has them, so TCP set-up is not in the first TTFTs.

The client shares the machine with the server it measures, so its cost per chunk is taken from the
server: aiohttp parses HTTP in C and, on uvloop, costs ~130 us of CPU per streamed chunk where
httpx on asyncio's loop costs ~310 (vllm bench serve's client is aiohttp too).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp
import httpx

from llmopt import defaults
from llmopt.bench.config import BenchConfig, Hooks, RunOutput
from llmopt.bench.datasets import SampleRequest
from llmopt.bench.metrics import RequestRecord, ServerCounters, parse_prometheus, server_stats
from llmopt.bench.schedule import Load, arrivals
from llmopt.errors import LLMOptError, UserInputError

_POLL = 0.05   # seconds between looks at the stop event while waiting


@dataclass
class Target:
    root: str          # the server's root URL (no /v1)
    url: str           # root + endpoint
    model: str
    model_root: str | None = None   # what /v1/models says the model is (a path on our server)


def server_root(base_url: str) -> str:
    """--base-url: the server root, or a URL ending in /v1 (accepted as vLLM's clients write it)."""
    root = base_url.strip().rstrip("/")
    if not root.startswith(("http://", "https://")):
        raise UserInputError(f"--base-url {base_url!r}: give an http:// or https:// URL, e.g. http://127.0.0.1:8000")
    return root[:-3] if root.endswith("/v1") else root


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _error_message(body: str) -> str:
    try:
        obj = json.loads(body)
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return _short(err["message"])
        if isinstance(err, str):
            return _short(err)
        if isinstance(obj, dict) and obj.get("detail"):
            return _short(obj["detail"])
    except (json.JSONDecodeError, AttributeError):
        pass
    return _short(body) or "(empty body)"


def resolve_target(cfg: BenchConfig, timeout: float = 30.0) -> Target:
    """The server's root and the model to ask for (--model, else the first of /v1/models)."""
    root = server_root(cfg.base_url)
    url = root + cfg.endpoint.rstrip("/")
    model, model_root = cfg.model, None
    try:
        r = httpx.get(root + "/v1/models", headers=_headers(cfg.api_key), timeout=timeout)
    except httpx.HTTPError as e:
        raise LLMOptError(f"cannot reach the server at {root}: {_short(e) or type(e).__name__}") from None
    if r.status_code == 200:
        try:
            data = r.json().get("data") or []
        except (json.JSONDecodeError, AttributeError):
            data = []
        first = next((m for m in data if model is None or m.get("id") == model), None) if data else None
        if first is not None:
            model = model or first.get("id")
            model_root = first.get("root")
    elif r.status_code == 401:
        raise UserInputError(f"{root}/v1/models answered 401: give the server's --api-key")
    if not model:
        raise UserInputError(f"{root}/v1/models lists no model: give --model")
    return Target(root, url, model, model_root)


def payload(cfg: BenchConfig, model: str, req: SampleRequest) -> dict:
    s = cfg.sampling
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                  "temperature": s.temperature}
    if cfg.chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.expected_output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.expected_output_len
    if s.ignore_eos:
        body["ignore_eos"] = True
    for k in ("top_p", "top_k", "min_p"):
        if getattr(s, k) is not None:
            body[k] = getattr(s, k)
    return body


async def _sse_data(resp: aiohttp.ClientResponse):
    """The payload of each `data:` line of an SSE body, as text, however the body is chunked."""
    buf = b""
    async for piece in resp.content.iter_any():
        buf += piece
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip().decode("utf-8", "replace")
    if buf.startswith(b"data:"):
        yield buf[5:].strip().decode("utf-8", "replace")


async def stream_request(client: aiohttp.ClientSession, url: str, body: dict, headers: dict, chat: bool,
                         rec: RequestRecord, clock_start: float) -> None:
    """Send one request and fill `rec` (times from `clock_start`, time.perf_counter()). Never raises,
    except cancellation."""
    st = time.perf_counter()
    rec.start_time = st - clock_start
    last_token = last_event = None
    finished = done = False
    text_parts: list[str] = []
    async with client.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {_error_message((await resp.read()).decode('utf-8', 'replace'))}"
            return
        async for data in _sse_data(resp):
            if data == "[DONE]":
                done = True
                break
            now = time.perf_counter()
            try:
                obj = json.loads(data)
            except json.JSONDecodeError:
                rec.error = f"a stream chunk is not JSON: {_short(data, 80)}"
                return
            if not isinstance(obj, dict):
                continue
            if obj.get("error") and not obj.get("choices"):
                err = obj["error"]
                rec.error = "error in the stream: " + _short(err.get("message") if isinstance(err, dict) else err)
                return
            usage = obj.get("usage")
            if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                rec.output_tokens = int(usage["completion_tokens"])
            for choice in (obj.get("choices") or [])[:1]:
                if chat:
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or delta.get("reasoning_content") or ""
                else:
                    text = choice.get("text") or ""
                if text:
                    if last_token is None:
                        rec.ttft = now - st
                    else:
                        rec.itl.append(now - last_token)
                    last_token = now
                    text_parts.append(text)
                if choice.get("finish_reason"):
                    finished = True
                if text or choice.get("finish_reason"):
                    last_event = now
    if not (done or finished):
        rec.error = "the stream ended before its last chunk"
        return
    end = last_event if last_event is not None else time.perf_counter()
    rec.latency = end - st
    if last_token is None:
        rec.ttft = rec.latency
    rec.generated_text = "".join(text_parts)
    rec.success = True


async def _one(client, url, body, headers, chat, rec, clock_start, timeout) -> None:
    try:
        await asyncio.wait_for(stream_request(client, url, body, headers, chat, rec, clock_start), timeout)
    except asyncio.TimeoutError:
        rec.success, rec.error = False, f"timeout after {timeout:g} s"
    except aiohttp.ClientError as e:
        rec.success, rec.error = False, f"{type(e).__name__}: {_short(e) or 'connection failed'}"
    except asyncio.CancelledError:
        rec.success, rec.cancelled = False, True
        raise
    except Exception as e:   # noqa: BLE001 - a request's failure is counted, never the benchmark's
        rec.success, rec.error = False, f"{type(e).__name__}: {_short(e)}"


async def scrape(client: aiohttp.ClientSession, root: str, headers: dict) -> ServerCounters | None:
    """The server's /metrics, parsed; None when it has none."""
    try:
        async with client.get(root + "/metrics", headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return None
            return parse_prometheus(await r.text())
    except Exception:   # noqa: BLE001 - no /metrics, or not Prometheus text: no server view
        return None


async def _sleep_until(t: float, stop) -> bool:
    """Sleep until time.perf_counter() reaches t; False if stopped first."""
    while True:
        if stop.is_set():
            return False
        left = t - time.perf_counter()
        if left <= 0:
            return True
        await asyncio.sleep(min(left, _POLL))


async def _get(client: aiohttp.ClientSession, url: str, headers: dict) -> None:
    async with client.get(url, headers=headers) as r:
        await r.read()


async def _warm_up(client: aiohttp.ClientSession, cfg: BenchConfig, target: Target, requests: list[SampleRequest],
                   load: Load, hooks: Hooks, description: str, headers: dict) -> None:
    """Open the connections before the clock starts, as a warm client has them, then send the warm-ups."""
    n = min(load.max_concurrency or len(requests), defaults.BENCH_PREOPEN_CONNECTIONS)
    await asyncio.gather(*(_get(client, target.root + "/v1/models", headers) for _ in range(n)),
                         return_exceptions=True)
    if not cfg.num_warmups:
        return
    hooks.start(f"{description}: warm-up", cfg.num_warmups)
    sem = asyncio.Semaphore(load.max_concurrency or cfg.num_warmups)

    async def warm() -> None:
        async with sem:
            await _one(client, target.url, payload(cfg, target.model, requests[0]), headers, cfg.chat,
                       RequestRecord(requests[0].prompt_len, requests[0].expected_output_len),
                       time.perf_counter(), cfg.request_timeout)
        hooks.advance(1)
    await asyncio.gather(*(warm() for _ in range(cfg.num_warmups)))


async def _sample_kv(client: aiohttp.ClientSession, target: Target, headers: dict, interval: float,
                     finished: asyncio.Event, kv: list[float]) -> None:
    """Append the server's KV-cache usage to `kv` every `interval` seconds until `finished`."""
    while not finished.is_set():
        got = await scrape(client, target.root, headers)
        if got is not None and got.kv_usage is not None:
            kv.append(got.kv_usage)
        try:
            await asyncio.wait_for(finished.wait(), interval)
        except asyncio.TimeoutError:
            pass


async def _send_all(client: aiohttp.ClientSession, cfg: BenchConfig, target: Target, requests: list[SampleRequest],
                    load: Load, hooks: Hooks, description: str,
                    headers: dict) -> tuple[list[RequestRecord], float, bool]:
    """Send the requests on the load's schedule and wait for them (or a stop); returns the records, the
    wall time from the first arrival slot to the end, and whether the run was interrupted."""
    total = len(requests) if load.duration is None else None
    hooks.start(description, total)
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    slots = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    start = time.perf_counter()

    def done(_task) -> None:
        if slots is not None:
            slots.release()
        hooks.advance(1)

    async def dispatch() -> None:
        for i, offset in enumerate(arrivals(load, len(requests))):
            if not await _sleep_until(start + offset, hooks.stop):
                return
            if slots is not None:
                while True:
                    try:
                        await asyncio.wait_for(slots.acquire(), _POLL)
                        break
                    except asyncio.TimeoutError:
                        if hooks.stop.is_set():
                            return
            if load.duration is not None and time.perf_counter() - start >= load.duration:
                if slots is not None:
                    slots.release()
                return
            req = requests[i % len(requests)]
            rec = RequestRecord(req.prompt_len, req.expected_output_len, scheduled_time=offset,
                                category=req.category)
            records.append(rec)
            task = asyncio.create_task(_one(client, target.url, payload(cfg, target.model, req), headers,
                                            cfg.chat, rec, start, cfg.request_timeout))
            task.add_done_callback(done)
            tasks.append(task)

    async def watch_stop() -> None:
        while not hooks.stop.is_set():
            await asyncio.sleep(_POLL)

    sender = asyncio.create_task(dispatch())
    stopper = asyncio.create_task(watch_stop())
    await asyncio.wait({sender, stopper}, return_when=asyncio.FIRST_COMPLETED)
    interrupted = hooks.stop.is_set()
    if not interrupted:
        pending = asyncio.gather(*tasks)
        await asyncio.wait({pending, stopper}, return_when=asyncio.FIRST_COMPLETED)
        interrupted = hooks.stop.is_set() and not pending.done()
    end = time.perf_counter()
    stopper.cancel()
    sender.cancel()
    for t in tasks:
        t.cancel()
    await asyncio.gather(sender, stopper, *tasks, return_exceptions=True)
    for rec, t in zip(records, tasks):
        if t.cancelled() and not rec.success:
            rec.cancelled = True
    return records, end - start, interrupted


async def _run(cfg: BenchConfig, target: Target, requests: list[SampleRequest], load: Load, hooks: Hooks,
               description: str) -> RunOutput:
    headers = _headers(cfg.api_key)
    connector = aiohttp.TCPConnector(limit=load.max_concurrency or 0, keepalive_timeout=defaults.BENCH_KEEPALIVE)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as client:
        await _warm_up(client, cfg, target, requests, load, hooks, description, headers)
        before = await scrape(client, target.root, headers)
        kv: list[float] = []
        finished = asyncio.Event()
        sampler = (asyncio.create_task(_sample_kv(client, target, headers, cfg.kv_sample_interval, finished, kv))
                   if before is not None else None)
        records, duration, interrupted = await _send_all(client, cfg, target, requests, load, hooks, description,
                                                         headers)
        finished.set()
        if sampler is not None:
            await sampler
        after = await scrape(client, target.root, headers) if before is not None else None
    return RunOutput(records, duration, server_stats(before, after, kv), interrupted, target.model)


def run_online(cfg: BenchConfig, target: Target, requests: list[SampleRequest], load: Load,
               hooks: Hooks | None = None, description: str = "bench") -> RunOutput:
    """One online benchmark run of `requests` under `load` against `target` (on uvloop when installed)."""
    main = _run(cfg, target, requests, load, hooks or Hooks(), description)
    try:
        import uvloop   # deferred: optional (no Windows build); asyncio's own loop without it
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
