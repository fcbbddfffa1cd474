"""Running one HTTP request's engine requests and streaming them, shared by every endpoint: the
`Job` (the engine requests of one HTTP request, closed exactly once), merging the streams of
several prompts, SSE framing with the in-band error event, and disconnect handling.

A client that disconnects (streaming or not) aborts its requests, which frees their KV blocks.
Streamed text is held back by `max stop string length - 1` characters until it is safe, so a stop
string that spans tokens never makes streamed text shrink: the concatenated deltas equal the
non-streamed text. A request the engine fails alone, once its stream has started, gets an in-band
error event (500); the others go on."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import aclosing
from typing import TYPE_CHECKING, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from llmopt.engine.async_engine import EngineStoppedError, RequestStream
from llmopt.core.outputs import CompletionOutput, RequestOutput
from llmopt.core.sampling_params import SamplingParams
from llmopt.errors import LLMOptError
from llmopt.serve.protocol import OpenAIError, error_body, usage

if TYPE_CHECKING:   # serving_engine imports this module
    from llmopt.serve.serving_engine import OpenAIServing

log = logging.getLogger("llmopt.serve")

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def stream_error(e: Exception, rid: str) -> str:
    """The error event of a stream that has started (OpenAI's error body, in-band)."""
    if isinstance(e, OpenAIError):
        return sse(error_body(e.message, e.status, e.type, e.param))
    if isinstance(e, EngineStoppedError):
        return sse(error_body(str(e), 503))
    if isinstance(e, LLMOptError):   # the engine failed this request, or is dead
        return sse(error_body(str(e), 500))
    log.exception("request %s failed", rid)
    return sse(error_body(f"{type(e).__name__}: {e}", 500))


async def merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


class Job:
    """The engine requests of one HTTP request (one per prompt), started together by
    `OpenAIServing.start` and closed exactly once: `aclose` aborts what has not finished, gives the
    sequences back to the admission count, records aborts and errors, and logs each request."""

    def __init__(self, serving: OpenAIServing, streams: list[RequestStream], params: SamplingParams,
                 arrival: float) -> None:
        self.serving, self.streams, self.params, self.arrival = serving, streams, params, arrival
        self.n = params.n * len(streams)
        self.done = [False] * len(streams)
        self.last: list[RequestOutput | None] = [None] * len(streams)
        self.error: Exception | None = None
        self.closed = False

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) as they come."""
        times: list[float | None] = [None] * len(self.streams)
        metrics = self.serving.metrics
        try:
            async with aclosing(merge(self.streams)) as merged:
                async for i, out in merged:
                    now = time.monotonic()
                    if times[i] is not None:
                        metrics.inter_token(now - times[i])
                    times[i] = now
                    self.last[i] = out
                    if out.finished:
                        self.done[i] = True
                        metrics.finished(out, self.arrival, self.params)
                        self.serving.log_request(self.streams[i].request_id, out, self.arrival)
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
        serving = self.serving
        serving.release(self.n)
        left = self.params.n * self.done.count(False)
        failed = isinstance(self.error, LLMOptError) and not isinstance(self.error, EngineStoppedError)
        serving.metrics.aborted(left, "error" if failed else "abort")
        for i, s in enumerate(self.streams):
            if not self.done[i]:
                serving.log_request(s.request_id, self.last[i], self.arrival,
                                    f"failed: {self.error}" if failed else
                                    "aborted (shutdown)" if isinstance(self.error, EngineStoppedError) else
                                    "aborted (the client left)")


class EventStream(StreamingResponse):
    """A StreamingResponse of SSE events that always closes its iterator and its job (so the engine
    requests it holds are aborted at once when the client leaves, even if the body never started)."""

    def __init__(self, content, job: Job) -> None:
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


class ChoiceState:
    """What one choice (prompt i, sample j) has streamed so far."""

    def __init__(self, index: int, prefix: str = "") -> None:
        self.index, self.sent, self.tokens_sent, self.prefix = index, 0, 0, prefix
        self.finished = False


# make_choice(state, output, new text, new logprobs, done) -> the choice of one chunk
MakeChoice = Callable[[ChoiceState, CompletionOutput, str, list, bool], dict]


async def stream_events(job: Job, num_prompts: int, state: dict[tuple[int, int], ChoiceState], hold: int,
                        make_choice: MakeChoice, chunk: Callable[[list[dict]], dict], include_usage: bool, rid: str,
                        first: tuple = ()) -> AsyncIterator[str]:
    """SSE events of one streamed request: `first`, then each choice's new text (the last `hold`
    characters held back until no stop string can still cut them, so streamed text never shrinks)
    and logprobs, then the usage when asked; an error after the stream started is reported in-band."""
    finals: list[RequestOutput | None] = [None] * num_prompts
    try:
        for event in first:
            yield sse(event)
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
                yield sse(chunk([choice]))
        if include_usage:
            yield sse({**chunk([]), "usage": usage(finals)})
    except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
        yield stream_error(e, rid)
    finally:
        await job.aclose()
    yield DONE


async def collect(request: Request, job: Job, num_prompts: int) -> list[RequestOutput | None] | None:
    """The final output of each prompt of a non-streamed request; None when the client left."""
    async def finals_of_job():
        finals: list[RequestOutput | None] = [None] * num_prompts
        async for i, out in job.outputs():
            if out.finished:
                finals[i] = out
        return finals

    try:
        return await unless_disconnected(request, finals_of_job())
    finally:
        await job.aclose()


async def until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, coro):
    """Await coro; if the client disconnects first, cancel it (aborting its requests) and return None."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(until_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    return None
