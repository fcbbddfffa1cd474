"""AsyncLLMEngine: the engine behind an asyncio server. One step loop owns the engine: it
runs in one long-lived compute thread (engine/threads.py: the same OS thread every step, so the
process keeps one OpenMP team): it queues and aborts requests between steps and steps again at once,
never waiting for the event loop, which routes each step's outputs to one stream per request while
the next step runs.

    engine = AsyncLLMEngine(LLMEngine(args))
    stream = engine.add_request("a", "Hello", SamplingParams(max_tokens=8))   # validated here
    async for out in stream:
        print(out.outputs[0].text)   # cumulative text so far

`add_request` is synchronous: the request is tokenized and validated at once (a bad one raises
UserInputError before anything streams), and its arrival time is the caller's. A request the engine
fails alone (see LLMEngine.step) raises RequestFailedError from its stream; the others go on. A
failure no request explains marks the engine dead (`dead`): every open stream raises
EngineDeadError, and so does every later add_request. With nothing to do the loop waits on an event;
it never spins.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import EngineDeadError, LLMEngine
from llmopt.core.outputs import RequestOutput
from llmopt.core.sampling_params import SamplingParams
from llmopt.engine.threads import ComputeThread
from llmopt.errors import LLMOptError, UserInputError

log = logging.getLogger("llmopt.engine")

_DONE = object()

__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineStoppedError", "IterationStats", "RequestFailedError",
           "RequestStream"]


class RequestFailedError(LLMOptError):
    """The engine failed on this request alone (its blocks are freed; the engine goes on)."""


class EngineStoppedError(LLMOptError):
    """The request was cut short because the server is shutting down."""


@dataclass
class Throughput:
    """Tokens the engine has computed since it started: prompt tokens (excluding prefix-cache
    hits) and generated tokens, counted as outputs arrive."""
    prompt_tokens: int = 0
    generation_tokens: int = 0


@dataclass
class IterationStats:
    """The tokens of one engine step that produced outputs, counted as vLLM's IterationStats: the
    prompts of the samples whose first token came this step (a prompt of n samples counts n times,
    prefix-cache hits included) and the tokens generated."""
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


class RequestStream:
    """The outputs of one request, as they come (cumulative RequestOutputs; the last is finished).
    `aclose()` (or leaving an `async with aclosing(...)` block, or cancellation of the reader
    followed by aclose) aborts the request if it has not finished, which frees its blocks."""

    def __init__(self, engine: "AsyncLLMEngine", request_id: str) -> None:
        self.engine, self.request_id = engine, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is _DONE:
            self.done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.error is not None:
            self.done = True
            raise RequestFailedError(f"the engine failed on request {self.request_id}: {item.error}")
        if item.finished:
            self.done = True
        return item

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self.engine.abort(self.request_id)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._streams: dict[str, RequestStream] = {}   # event-loop side only
        self._lock = threading.Lock()                   # guards _adds and _aborts (loop <-> compute thread)
        self._adds: list = []                           # prepared prompts to queue before the next step
        self._aborts: list[tuple[str, BaseException | None]] = []
        self._work = threading.Event()                  # set when there is something to queue or abort
        self._compute: ComputeThread | None = None      # made by the first request: the thread that steps
        self._stepping: concurrent.futures.Future | None = None   # the step loop running in it
        self._stopping = False
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._seen: dict[str, list[int]] = {}           # request id -> output tokens counted so far, per sample
        self._dead: EngineDeadError | None = None       # set once a step failed for no request's reason
        self.num_steps = 0                              # steps run (a loop that waits runs none)
        self.throughput = Throughput()
        # called (in the event loop) with the IterationStats of each step that produced outputs
        self.iteration_listeners: list[Callable[[IterationStats], None]] = []

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs) -> "AsyncLLMEngine":
        return cls(LLMEngine(args, **kwargs))

    @property
    def dead(self) -> EngineDeadError | None:
        """Why the engine serves nothing more: a step failed for no request's reason, or (looked at
        each time) the engine reports itself dead while idle (a tensor-parallel worker exited)."""
        if self._dead is None:
            try:
                self.engine.check_health()
            except EngineDeadError as e:
                self._die(e)
        return self._dead

    @property
    def num_open(self) -> int:
        """Requests added and not yet finished, aborted or failed."""
        return len(self._streams)

    @property
    def stepping(self) -> bool:
        """Whether the step loop runs (it waits, without spinning, while there is no work)."""
        return self._stepping is not None and not self._stepping.done()

    def _ensure_loop(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        if self._compute is None:
            self._compute = ComputeThread(name="llmopt-engine")
        if not self.stepping:
            self._stopping = False
            self._stepping = self._compute.submit(self._step_loop)

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None) -> RequestStream:
        """Validate a request now (UserInputError if it is bad; EngineDeadError if the engine is
        dead) and queue it for the next step; returns the stream of its outputs. `arrival_time`
        (time.monotonic()) defaults to now."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        if rid in self._streams:
            raise UserInputError(f"request id {rid!r} is already in use")
        parent = self.engine.prepare_request(rid, prompt, params or SamplingParams(), priority,
                                             time.monotonic() if arrival_time is None else arrival_time,
                                             prompt_token_ids)
        stream = RequestStream(self, rid)
        self._streams[rid] = stream
        with self._lock:
            self._adds.append(parent)
        self._ensure_loop()
        self._work.set()
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """add_request and iterate its stream (a bad request raises at the first iteration); the
        request is aborted if the consumer stops early."""
        stream = self.add_request(request_id, prompt, params, priority, arrival_time)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Stop a request before the next step; its stream ends (raising `error` if given)."""
        if request_id in self._streams:
            with self._lock:
                self._aborts.append((request_id, error))
            self._work.set()

    def abort_all(self, error: BaseException | None = None) -> None:
        """Abort every open request (a shutdown); their streams raise `error` if given."""
        for rid in list(self._streams):
            self.abort(rid, error)

    async def stop(self) -> None:
        """Stop the step loop and its thread (the server is going away)."""
        self._stopping = True
        self._work.set()
        if self._compute is not None:
            compute, self._compute = self._compute, None
            await asyncio.to_thread(compute.close)   # after the step in flight

    # -- the step loop, in the compute thread ----------------------------------------------------
    def _post(self, fn, *args) -> bool:
        """Run fn(*args) in the event loop's thread (the streams live there); False once it is closed."""
        try:
            self._event_loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:
            return False

    def _step_loop(self) -> None:
        """Queue the new requests and apply the aborts, then step, until stopped: the engine's next
        step never waits for the event loop, which routes each step's outputs meanwhile."""
        engine = self.engine
        while not self._stopping:
            self._work.clear()
            with self._lock:
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            failed = []
            for parent in adds:
                try:
                    engine.add_prepared(parent)
                except Exception as e:  # noqa: BLE001 - a bad request fails alone
                    failed.append((parent.request_id, e))
            for rid, _ in aborts:
                engine.abort_request(rid)
            if (failed or aborts) and not self._post(self._end_streams, failed, aborts):
                return
            if not engine.has_unfinished_requests():
                self._work.wait()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - no request explains it: the engine is dead
                self._post(self._die, e)
                return
            self.num_steps += 1
            if not self._post(self._route, outputs):
                return

    # -- the event loop's side -------------------------------------------------------------------
    def _end_streams(self, failed: list[tuple[str, BaseException]],
                     aborts: list[tuple[str, BaseException | None]]) -> None:
        for rid, error in failed:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.queue.put_nowait(error)
        for rid, error in aborts:
            self._seen.pop(rid, None)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.queue.put_nowait(error if error is not None else _DONE)

    def _count(self, out: RequestOutput, step: IterationStats) -> None:
        """Add one output's new tokens to the throughput and the step's IterationStats."""
        tp = self.throughput
        seen = self._seen.get(out.request_id)
        if seen is None:   # its first output: the prompt is computed
            tp.prompt_tokens += max(len(out.prompt_token_ids) - out.num_cached_tokens, 0)
            seen = [0] * len(out.outputs)
        now = [len(c.token_ids) for c in out.outputs]
        step.num_prompt_tokens += len(out.prompt_token_ids) * sum(1 for a, b in zip(seen, now) if not a and b)
        step.num_generation_tokens += sum(now) - sum(seen)
        tp.generation_tokens += sum(now) - sum(seen)
        if out.finished:
            self._seen.pop(out.request_id, None)
        else:
            self._seen[out.request_id] = now

    def _route(self, outputs: list[RequestOutput]) -> None:
        step = IterationStats()
        for out in outputs:
            self._count(out, step)
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait(out)
                if out.finished:
                    del self._streams[out.request_id]
        if outputs:
            for listener in self.iteration_listeners:
                listener(step)

    def _die(self, error: BaseException) -> None:
        message = str(error) if isinstance(error, EngineDeadError) else \
            f"the engine failed: {type(error).__name__}: {error}"
        log.error("%s; failing %d open requests", message, len(self._streams))
        self._dead = EngineDeadError(message)
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(message))
        self._streams.clear()
        with self._lock:
            self._adds.clear()
            self._aborts.clear()
