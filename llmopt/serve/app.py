"""The OpenAI-compatible HTTP server: a FastAPI app over AsyncLLMEngine.

    app = build_app(AsyncLLMEngine(LLMEngine(args)), ServeConfig(model_name="smollm2-135m"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Every request is validated completely before anything is queued or streamed (types by pydantic,
ranges by SamplingParams, then against the model: vocabulary, context length, logprobs cap; the
engine's own `add_request` checks again, synchronously), so a bad request is a 400 in OpenAI's error
shape and never reaches the engine's step. A body above `max_request_bytes` is a 413 before it is
parsed. A client that disconnects (streaming or not) aborts its requests, which frees their KV
blocks. Streamed text is held back by `max stop string length - 1` characters until it is safe, so a
stop string that spans tokens never makes streamed text shrink: the concatenated deltas equal the
non-streamed text.

Failures: a request the engine fails alone gets a 500 (in-band, as an error event, once its stream
has started); the others go on. When the engine is dead, /health answers 503, open requests fail
with 500 and new ones get 503. Shutdown (`OpenAIServer.drain`, called by run.py on SIGTERM): new
requests get 503, in-flight ones may finish for `--shutdown-timeout` seconds, the rest are aborted
with a 503 error. Logs: one line per finished request and, every `log_interval` seconds while there
is work, throughput, running/waiting requests and KV-cache usage, as vLLM logs them."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmopt import __version__, defaults
from llmopt.engine.async_engine import AsyncLLMEngine, EngineStoppedError, RequestStream
from llmopt.engine.outputs import RequestOutput
from llmopt.engine.sampling_params import SamplingParams
from llmopt.errors import LLMOptError, UserInputError
from llmopt.serve.metrics import CONTENT_TYPE, ServerMetrics
from llmopt.serve.protocol import (ChatCompletionRequest, CompletionRequest,
                                   DetokenizeRequest, OpenAIError, TokenizeRequest, error_body, message_text)

log = logging.getLogger("llmopt.serve")

LOGPROB_FLOOR = -9999.0   # vLLM's stand-in for -inf (JSON has no infinities)


@dataclass
class ServeConfig:
    model_name: str
    api_key: str | None = None
    max_num_queued_reqs: int | None = None   # running + waiting (n counted as n) above this: 503
    max_n: int | None = None                 # cap on n (default: the engine's max_num_seqs)
    max_request_bytes: int = defaults.SERVE_MAX_REQUEST_BYTES   # a larger body: 413
    log_interval: float = defaults.SERVE_LOG_INTERVAL       # periodic stats line every this many seconds (0: never)
    log_requests: bool = True                # one line per finished request


def _error(e: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.status, e.type, e.param), status_code=e.status)


def _lp(x: float) -> float:
    return x if x == x and x > LOGPROB_FLOOR else LOGPROB_FLOOR


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def _stream_error(e: Exception, rid: str) -> str:
    """The error event of a stream that has started (OpenAI's error body, in-band)."""
    if isinstance(e, OpenAIError):
        return _sse(error_body(e.message, e.status, e.type, e.param))
    if isinstance(e, EngineStoppedError):
        return _sse(error_body(str(e), 503))
    if isinstance(e, LLMOptError):   # the engine failed this request, or is dead
        return _sse(error_body(str(e), 500))
    log.exception("request %s failed", rid)
    return _sse(error_body(f"{type(e).__name__}: {e}", 500))


class _Stream(StreamingResponse):
    """A StreamingResponse that always closes its iterator and its job (so the engine requests it
    holds are aborted at once when the client leaves, even if the body never started)."""

    def __init__(self, content, job: "_Job") -> None:
        super().__init__(content, media_type="text/event-stream")
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            await self.job.aclose()


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's index. Leaving early
    (or being cancelled) cancels every request still running, which aborts it in the engine."""
    if len(gens) == 1:
        async with aclosing(gens[0]) as g:
            async for out in g:
                yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, g: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(g):
                async for out in g:
                    q.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            q.put_nowait((i, e))
        q.put_nowait((i, end))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is end:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Choice:
    """What one completion (prompt i, sample j) has streamed so far."""

    def __init__(self, index: int, prefix: str = "") -> None:
        self.index, self.sent, self.tokens_sent, self.prefix = index, 0, 0, prefix
        self.finished = False


class _Job:
    """The engine requests of one HTTP request (one per prompt), started together by
    `OpenAIServer.start` and closed exactly once: `aclose` aborts what has not finished, gives the
    sequences back to the admission count, records aborts and errors, and logs each request."""

    def __init__(self, server: "OpenAIServer", streams: list[RequestStream], params: SamplingParams,
                 arrival: float) -> None:
        self.server, self.streams, self.params, self.arrival = server, streams, params, arrival
        self.n = params.n * len(streams)
        self.done = [False] * len(streams)
        self.last: list[RequestOutput | None] = [None] * len(streams)
        self.error: Exception | None = None
        self.closed = False

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) as they come."""
        times: list[float | None] = [None] * len(self.streams)
        metrics = self.server.metrics
        try:
            async with aclosing(_merge(self.streams)) as merged:
                async for i, out in merged:
                    now = time.monotonic()
                    if times[i] is not None:
                        metrics.inter_token(now - times[i])
                    times[i] = now
                    self.last[i] = out
                    if out.finished:
                        self.done[i] = True
                        metrics.finished(out, self.arrival)
                        self.server.log_request(self.streams[i].request_id, out, self.arrival)
                    yield i, out
        except Exception as e:
            self.error = e
            raise

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        for s in self.streams:
            await s.aclose()
        server = self.server
        server.in_flight -= self.n
        left = self.params.n * self.done.count(False)
        failed = isinstance(self.error, LLMOptError) and not isinstance(self.error, EngineStoppedError)
        server.metrics.aborted(left, "error" if failed else "abort")
        for i, s in enumerate(self.streams):
            if not self.done[i]:
                server.log_request(s.request_id, self.last[i], self.arrival,
                                   f"failed: {self.error}" if failed else
                                   "aborted (shutdown)" if isinstance(self.error, EngineStoppedError) else
                                   "aborted (the client left)")


class OpenAIServer:
    def __init__(self, engine: AsyncLLMEngine, config: ServeConfig) -> None:
        self.engine = engine
        self.llm = engine.engine
        self.config = config
        self.tokenizer = self.llm.tokenizer
        self.vocab_size = self.llm.loaded.config.vocab_size
        self.max_model_len = self.llm.max_model_len
        self.max_n = config.max_n or self.llm.args.max_num_seqs
        self.metrics = ServerMetrics(config.model_name, self.llm.stats)
        self.in_flight = 0   # sequences (n counted as n) the server has queued and not finished
        self.draining = False   # shutting down: new requests get 503

    # -- validation ------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model", "NotFoundError")

    def sampling_params(self, r, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if r.n > self.max_n:
            raise OpenAIError(f"n must be at most {self.max_n}, got {r.n}", 400, "n")
        if r.priority and self.llm.args.scheduling_policy != "priority":
            raise OpenAIError(f"priority {r.priority} is only allowed with --scheduling-policy priority (this "
                              f"server runs {self.llm.args.scheduling_policy}): send 0 or omit it", 400, "priority")
        kw: dict[str, Any] = dict(
            n=r.n, temperature=1.0 if r.temperature is None else r.temperature,
            top_p=1.0 if r.top_p is None else r.top_p, top_k=r.top_k or 0,
            min_p=r.min_p or 0.0, seed=r.seed, presence_penalty=r.presence_penalty or 0.0,
            frequency_penalty=r.frequency_penalty or 0.0,
            repetition_penalty=1.0 if r.repetition_penalty is None else r.repetition_penalty,
            stop=[r.stop] if isinstance(r.stop, str) else list(r.stop or []),
            stop_token_ids=list(r.stop_token_ids or []), include_stop_str_in_output=r.include_stop_str_in_output,
            max_tokens=max_tokens, min_tokens=r.min_tokens, ignore_eos=r.ignore_eos, logprobs=logprobs,
            skip_special_tokens=r.skip_special_tokens)
        try:
            return SamplingParams(**kw)
        except (UserInputError, ValueError, TypeError) as e:
            raise OpenAIError(str(e), 400) from None

    def check_prompt(self, ids: list[int], params: SamplingParams, what: str = "prompt") -> None:
        if not ids:
            raise OpenAIError("the prompt is empty", 400, what)
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise OpenAIError(f"prompt token ids must be in [0, {self.vocab_size})", 400, what)
        want = len(ids) + (params.max_tokens or 1)
        if want > self.max_model_len or len(ids) >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{want} tokens ({len(ids)} in the {'messages' if what == 'messages' else 'prompt'}, "
                f"{params.max_tokens or 1} for the completion). Please reduce the length of the "
                f"{'messages' if what == 'messages' else 'prompt'} or completion.", 400, what)

    def tokenize_text(self, text: str, add_special_tokens: bool = True, what: str = "prompt") -> list[int]:
        if self.tokenizer is None:
            raise OpenAIError("this model has no tokenizer: send token ids", 400, what)
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        except (TypeError, ValueError) as e:   # e.g. a lone surrogate ("\ud800"), which UTF-8 cannot encode
            raise OpenAIError(f"the {what} cannot be tokenized ({type(e).__name__}): send valid Unicode text "
                              "(no lone surrogates)", 400, what) from None

    def chat_prompt(self, messages, add_generation_prompt: bool = True, kwargs: dict | None = None) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError("this model's tokenizer has no chat template", 400, "messages")
        conv = [{"role": m.role, "content": message_text(m)} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      **(kwargs or {}))
        except Exception as e:  # noqa: BLE001 - a template's own error (e.g. roles out of order)
            raise OpenAIError(f"the chat template failed on these messages: {e}", 400, "messages") from None
        if not isinstance(text, str):   # chat_template_kwargs asked for something else (return_dict, ...)
            raise OpenAIError(f"the chat template gave a {type(text).__name__}, not text: drop the "
                              "chat_template_kwargs that change its output", 400, "chat_template_kwargs")
        return text

    def admit(self, n: int) -> None:
        cap = self.config.max_num_queued_reqs
        if cap is not None and self.in_flight + n > cap:
            raise OpenAIError(f"the server is at capacity ({cap} queued sequences): retry later", 503)

    # -- running requests ------------------------------------------------------------------------
    def start(self, prompts: list[list[int]], params: SamplingParams, prefix: str, arrival: float,
              priority: int = 0) -> _Job:
        """Queue one engine request per prompt now (synchronously: a request the engine refuses
        is a 400 here, before any response starts); the caller must `aclose` the job."""
        if self.draining:
            raise OpenAIError("the server is shutting down: retry on another replica", 503)
        if self.engine.dead is not None:
            raise OpenAIError(f"the engine is dead ({self.engine.dead}): restart the server", 503)
        self.admit(params.n * len(prompts))
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(self.engine.add_request(f"{prefix}-{i}", ids, params, priority, arrival))
        except UserInputError as e:
            for st in streams:
                self.engine.abort(st.request_id)
            raise OpenAIError(str(e), 400, "prompt") from None
        except BaseException:
            for st in streams:
                self.engine.abort(st.request_id)
            raise
        self.in_flight += params.n * len(prompts)
        return _Job(self, streams, params, arrival)

    def log_request(self, request_id: str, out: RequestOutput | None, arrival: float, how: str | None = None) -> None:
        """One line per request that ended: how, its tokens, and its latencies (vLLM logs one too)."""
        if not self.config.log_requests:
            return
        if out is None:
            log.info("request %s %s before its prompt was computed", request_id, how)
            return
        m = out.metrics
        gen = sum(len(c.token_ids) for c in out.outputs)
        reasons = ",".join(sorted({c.finish_reason for c in out.outputs if c.finish_reason})) or "-"

        def since(t: float | None) -> str:
            return "-" if t is None else f"{max(t - arrival, 0.0):.3f} s"
        log.info("request %s %s: prompt %d tokens (%d cached), output %d tokens, queue %s, TTFT %s, e2e %s",
                 request_id, how or f"finished ({reasons})", len(out.prompt_token_ids), out.num_cached_tokens, gen,
                 since(m.first_scheduled_time if m else None), since(m.first_token_time if m else None),
                 since(m.finished_time if m and m.finished_time else time.monotonic()))

    async def log_stats_forever(self, interval: float) -> None:
        """Every `interval` seconds while there is work (and once when it stops): prompt and
        generation throughput, running/waiting requests, KV-cache usage, prefix-cache hit rate."""
        tp = self.engine.throughput
        last_t, last_p, last_g = time.monotonic(), tp.prompt_tokens, tp.generation_tokens
        was_idle = True
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            s = self.llm.stats()
            dp, dg = tp.prompt_tokens - last_p, tp.generation_tokens - last_g
            idle = not (dp or dg or s.num_running or s.num_waiting)
            if not (idle and was_idle):
                dt = max(now - last_t, 1e-9)
                log.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                         "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                         dp / dt, dg / dt, s.num_running, s.num_waiting, 100 * s.kv_cache_usage,
                         100 * s.prefix_cache_hit_rate)
            was_idle = idle
            last_t, last_p, last_g = now, tp.prompt_tokens, tp.generation_tokens

    async def drain(self, timeout: float) -> None:
        """Shut down: new requests get 503 from now on; in-flight ones may finish for up to
        `timeout` seconds; the rest are aborted (their clients get a 503 error)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        if self.in_flight:
            log.info("shutting down: %d sequences in flight, waiting up to %g s for them", self.in_flight, timeout)
        deadline = loop.time() + timeout
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            log.info("shutting down: aborting %d sequences", self.in_flight)
            self.engine.abort_all(EngineStoppedError("the server is shutting down: the request was aborted"))
            deadline = loop.time() + 5
            while self.in_flight and loop.time() < deadline:   # their responses end
                await asyncio.sleep(0.02)
        await self.engine.stop()

    def logprobs_completion(self, lps, offset: int) -> dict:
        dec = self.tokenizer.decode if self.tokenizer is not None else (lambda ids: str(ids[0]))
        tokens, token_lps, tops, offsets = [], [], [], []
        for t in lps:
            s = dec([t.token_id])
            tokens.append(s)
            token_lps.append(_lp(t.logprob))
            tops.append({dec([k]): _lp(v) for k, v in t.top.items()} or None)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def logprobs_chat(self, lps) -> dict:
        dec = self.tokenizer.decode if self.tokenizer is not None else (lambda ids: str(ids[0]))

        def entry(tid, lp):
            s = dec([tid])
            return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8"))}
        return {"content": [{**entry(t.token_id, t.logprob),
                             "top_logprobs": [entry(k, v) for k, v in t.top.items()]} for t in lps]}


def _usage(finals: list[RequestOutput | None]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in finals if o is not None)
    completion = sum(len(c.token_ids) for o in finals if o is not None for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals if o is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _stream_events(job: "_Job", num_prompts: int, state: dict, hold: int, make_choice, chunk,
                         include_usage: bool, rid: str, first: tuple = ()):
    """SSE events of one streamed request: each choice's new text (the last `hold` characters held
    back until no stop string can still cut them, so streamed text never shrinks) and logprobs, then
    the usage when asked; an error after the stream started is reported in-band."""
    finals: list[RequestOutput | None] = [None] * num_prompts
    try:
        for event in first:
            yield _sse(event)
        async for i, out in job.outputs():
            if out.finished:
                finals[i] = out
            for c in out.outputs:
                st = state[(i, c.index)]
                if st.finished:
                    continue
                done = c.finish_reason is not None
                upto = len(c.text) if done else max(st.sent, len(c.text) - hold)
                delta = c.text[st.sent:upto]
                new_lps = (c.logprobs or [])[st.tokens_sent:]
                if not delta and not done and not new_lps and not st.prefix:
                    continue
                choice = make_choice(st, c, delta, new_lps, done)
                st.sent, st.tokens_sent, st.prefix, st.finished = upto, len(c.token_ids), "", done
                yield _sse(chunk([choice]))
        if include_usage:
            yield _sse({**chunk([]), "usage": _usage(finals)})
    except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
        yield _stream_error(e, rid)
    finally:
        await job.aclose()
    yield "data: [DONE]\n\n"


async def _collect(request: Request, job: "_Job", num_prompts: int) -> list[RequestOutput | None] | None:
    """The final output of each prompt of a non-streamed request; None when the client left."""
    async def collect():
        finals: list[RequestOutput | None] = [None] * num_prompts
        async for i, out in job.outputs():
            if out.finished:
                finals[i] = out
        return finals

    try:
        return await _unless_disconnected(request, collect())
    finally:
        await job.aclose()


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, coro):
    """Await coro; if the client disconnects first, cancel it (aborting its requests) and return None."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    return None


class _ApiKey:
    """Plain ASGI middleware (not BaseHTTPMiddleware, which gets in the way of streaming and
    disconnects): /v1/* needs `Authorization: Bearer KEY`, as vLLM's --api-key."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            if auth != self.expected:
                await _error(OpenAIError("Unauthorized: a valid API key is required", 401))(scope, receive, send)
                return
        await self.app(scope, receive, send)


ARRIVAL = "llmopt.arrival"   # scope key: time.monotonic() when the request reached the server


class _BodyLimit:
    """Plain ASGI middleware: stamps each request's arrival time, and reads a request body whole
    before the app does, answering 413 as soon as it passes `limit` bytes (by its Content-Length,
    or while it arrives when chunked). The app then reads the body from memory; later receive()
    calls (disconnects) go to the client."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[ARRIVAL] = time.monotonic()
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await _error(OpenAIError(f"Content-Length {length[:40]!r} is not a number", 400))(scope, receive, send)
                return
            if declared > self.limit:
                await self._too_large(declared, scope, receive, send)
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                await self._too_large(size, scope, receive, send, at_least=True)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, size: int, scope, receive, send, at_least: bool = False) -> None:
        given = f"over {self.limit:,} bytes (sent in chunks)" if at_least else f"{size:,} bytes"
        await _error(OpenAIError(f"the request body is {given}; at most {self.limit:,} bytes are allowed "
                                 "(--max-request-bytes)", 413))(scope, receive, send)


def _arrival(request: Request) -> float:
    return request.scope.get(ARRIVAL) or time.monotonic()


def build_app(engine: AsyncLLMEngine, config: ServeConfig) -> FastAPI:
    server = OpenAIServer(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        import anyio
        await anyio.sleep(0)   # loads anyio's asyncio backend now, not in the first stream (~0.5 s of its TTFT)
        stats = asyncio.create_task(server.log_stats_forever(config.log_interval)) if config.log_interval > 0 else None
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
                await asyncio.gather(stats, return_exceptions=True)
            await engine.stop()

    app = FastAPI(title="llmopt", version=__version__, lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return _error(OpenAIError("the request body is not valid JSON (or not UTF-8)", 400))
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: "
                            f"{err.get('msg', 'invalid')}" for err in errors[:5])
        return _error(OpenAIError(message or "invalid request", 400, ".".join(loc) or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return _error(OpenAIError(str(e.detail), e.status_code, type="NotFoundError" if e.status_code == 404 else None))

    @app.exception_handler(UserInputError)
    async def _user_error(request: Request, e: UserInputError):
        return _error(OpenAIError(str(e), 400))

    @app.exception_handler(EngineStoppedError)
    async def _stopped(request: Request, e: EngineStoppedError):
        return _error(OpenAIError(str(e), 503))

    @app.exception_handler(LLMOptError)
    async def _engine_error(request: Request, e: LLMOptError):   # RequestFailedError, EngineDeadError
        return _error(OpenAIError(str(e), 500))

    app.add_middleware(_BodyLimit, limit=config.max_request_bytes)
    if config.api_key:
        app.add_middleware(_ApiKey, api_key=config.api_key)   # outermost: no body is read without the key

    @app.get("/health")
    async def health():
        if engine.dead is not None:
            return _error(OpenAIError(f"the engine is dead: {engine.dead}", 503))
        if server.draining:
            return _error(OpenAIError("the server is shutting down", 503))
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "llmopt", "root": str(server.llm.loaded.path),
                                            "max_model_len": server.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", 400, "prompt")
        if body.messages is not None:
            text = server.chat_prompt(body.messages, body.add_generation_prompt)
            ids = server.tokenize_text(text, add_special_tokens=False, what="messages")
        else:
            ids = server.tokenize_text(body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        server.check_model(body.model)
        if any(not 0 <= t < server.vocab_size for t in body.tokens):
            raise OpenAIError(f"token ids must be in [0, {server.vocab_size})", 400, "tokens")
        if server.tokenizer is None:
            raise OpenAIError("this model has no tokenizer", 400)
        return {"prompt": server.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival = _arrival(request)
        server.check_model(body.model)
        if body.suffix:
            raise OpenAIError("suffix is not supported", 400, "suffix")
        if body.echo and body.logprobs is not None:
            raise OpenAIError("echo with logprobs is not supported", 400, "echo")
        p = body.prompt
        if isinstance(p, str):
            texts, prompts = [p], [server.tokenize_text(p)]
        elif not p:
            raise OpenAIError("the prompt is empty", 400, "prompt")
        elif isinstance(p[0], int):
            texts, prompts = [None], [list(p)]
        elif isinstance(p[0], str):
            texts, prompts = list(p), [server.tokenize_text(t) for t in p]
        else:
            texts, prompts = [None] * len(p), [list(x) for x in p]
        params = server.sampling_params(body, body.max_tokens, body.logprobs)
        for ids in prompts:
            server.check_prompt(ids, params)
        n = params.n
        echo = [(t if t is not None else server.tokenizer.decode(ids)) if body.echo else ""
                for t, ids in zip(texts, prompts)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        hold = max((len(s) for s in params.stop), default=1) - 1
        job = server.start(prompts, params, rid, arrival, body.priority)

        def chunk(choices: list[dict]) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": config.model_name,
                    "choices": choices}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            state = {(i, j): _Choice(i * n + j, echo[i]) for i in range(len(prompts)) for j in range(n)}

            def make_choice(st, c, delta, new_lps, done):
                choice = {"index": st.index, "text": st.prefix + delta, "logprobs": None,
                          "finish_reason": c.finish_reason if done else None,
                          "stop_reason": c.stop_reason if done else None}
                if body.logprobs is not None:
                    choice["logprobs"] = server.logprobs_completion(new_lps, st.sent)
                return choice

            return _Stream(_stream_events(job, len(prompts), state, hold, make_choice, chunk, include_usage, rid), job)

        finals = await _collect(request, job, len(prompts))
        if finals is None:
            return Response(status_code=499)
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                choice = {"index": i * n + c.index, "text": echo[i] + c.text, "logprobs": None,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if body.logprobs is not None:
                    choice["logprobs"] = server.logprobs_completion(c.logprobs or [], 0)
                choices.append(choice)
        return {**chunk(choices), "usage": _usage(finals)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        arrival = _arrival(request)
        server.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", 400, "top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        text = server.chat_prompt(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
        ids = server.tokenize_text(text, add_special_tokens=False, what="messages")
        params = server.sampling_params(body, max_tokens, logprobs)
        server.check_prompt(ids, params, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        hold = max((len(s) for s in params.stop), default=1) - 1
        job = server.start([ids], params, rid, arrival, body.priority)

        def chunk(choices: list[dict], obj: str = "chat.completion.chunk") -> dict:
            return {"id": rid, "object": obj, "created": created, "model": config.model_name, "choices": choices}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            state = {(0, j): _Choice(j) for j in range(params.n)}
            first = tuple(chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]) for j in range(params.n))

            def make_choice(st, c, delta, new_lps, done):
                choice = {"index": c.index, "delta": {"content": delta} if delta else {},
                          "logprobs": server.logprobs_chat(new_lps) if logprobs is not None else None,
                          "finish_reason": c.finish_reason if done else None}
                if done:
                    choice["stop_reason"] = c.stop_reason
                return choice

            return _Stream(_stream_events(job, 1, state, hold, make_choice, chunk, include_usage, rid, first), job)

        finals = await _collect(request, job, 1)
        if finals is None:
            return Response(status_code=499)
        final = finals[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": server.logprobs_chat(c.logprobs or []) if logprobs is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in final.outputs]
        return {**chunk(choices, "chat.completion"), "usage": _usage([final])}

    return app
