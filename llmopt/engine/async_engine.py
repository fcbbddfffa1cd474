"""AsyncLLMEngine: the engine behind an asyncio server. One background task owns the engine: it
adds and aborts requests between steps, runs each step in a worker thread (so the event loop keeps
serving), and routes outputs to one queue per request.

    engine = AsyncLLMEngine(LLMEngine(args))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), request_id="a"):
        print(out.outputs[0].text)   # cumulative text so far
"""

from __future__ import annotations

import asyncio
import itertools
from typing import AsyncIterator

from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.engine.outputs import RequestOutput
from llmopt.engine.sampling_params import SamplingParams
from llmopt.errors import UserInputError

_DONE = object()


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._adds: list[tuple] = []
        self._aborts: list[str] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs) -> "AsyncLLMEngine":
        return cls(LLMEngine(args, **kwargs))

    def _ensure_loop(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its (cumulative) outputs as they come; aborts it if the consumer
        stops early."""
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        if rid in self._queues:
            raise UserInputError(f"request id {rid!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        self._adds.append((rid, prompt, params or SamplingParams(), priority))
        self._ensure_loop()
        self._wake.set()
        finished = False
        try:
            while True:
                item = await q.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Stop a request; its generate() iterator ends."""
        if request_id in self._queues:
            self._aborts.append(request_id)
            if self._wake is not None:
                self._wake.set()

    async def _run(self) -> None:
        while True:
            adds, self._adds = self._adds, []
            for rid, prompt, params, priority in adds:
                try:
                    self.engine.add_request(rid, prompt, params, priority)
                except Exception as e:  # a bad request fails alone
                    self._queues.pop(rid, asyncio.Queue()).put_nowait(e)
            aborts, self._aborts = self._aborts, []
            for rid in aborts:
                self.engine.abort_request(rid)
                q = self._queues.pop(rid, None)
                if q is not None:
                    q.put_nowait(_DONE)
            if not self.engine.has_unfinished_requests():
                self._wake.clear()
                if not self._adds and not self._aborts:
                    await self._wake.wait()
                continue
            try:
                outputs = await asyncio.to_thread(self.engine.step)
            except Exception as e:
                for q in self._queues.values():
                    q.put_nowait(e)
                self._queues.clear()
                raise
            for out in outputs:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
                    if out.finished:
                        del self._queues[out.request_id]
