"""Continuous batching with chunked prefill, as in vLLM v1: there are no prefill or decode phases,
only requests whose computed-token count catches up with their token count.

Each step spends a token budget (`max_num_batched_tokens`): first on running requests (decodes,
the next chunk of a long prompt, draft tokens to verify), then on waiting requests in policy order
(FCFS, or priority: lower value first, then arrival), while fewer than `max_num_seqs` run. When the
KV cache runs out of blocks, the lowest-priority running request is preempted: its blocks are freed
and it goes back to the front of the queue, to be recomputed later (from prefix-cache hits if its
blocks survive).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from llmopt.cache.kv_manager import KVCacheManager
from llmopt.engine.request import Request, RequestStatus
from llmopt.errors import UserInputError

POLICIES = ("fcfs", "priority")


@dataclass
class ScheduledRequest:
    """What the runner needs to compute one request's tokens this step (self-contained, so it could
    be sent to another process or rank)."""
    request_id: str
    token_ids: list[int]     # the tokens to compute: a prompt chunk, the last sampled token, drafts
    start_pos: int           # position of token_ids[0] (= tokens already in the cache)
    block_ids: list[int]     # the request's whole block table
    num_logits: int          # trailing positions whose logits are wanted (0: a prompt chunk)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """FCFS: a deque (preempted requests go back to the front). Priority: kept sorted."""

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise UserInputError(f"unknown scheduling policy {policy!r}: use {' or '.join(POLICIES)}")
        self.priority = policy == "priority"
        self._q: deque[Request] | list[Request] = [] if self.priority else deque()

    def add(self, req: Request) -> None:
        if self.priority:
            bisect.insort(self._q, req)
        else:
            self._q.append(req)

    def add_front(self, req: Request) -> None:
        if self.priority:
            bisect.insort(self._q, req)
        else:
            self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.pop(0) if self.priority else self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(list(self._q))


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs") -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise UserInputError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def num_unfinished(self) -> int:
        return len(self.running) + len(self.waiting)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Finish (stop, length) or abort a request: release its blocks and forget it."""
        if req.request_id not in self.requests:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        self.kv.forget(req)
        del self.requests[req.request_id]

    def abort_request(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return req

    # -- scheduling ----------------------------------------------------------------------------
    def _victim(self) -> Request:
        if self.waiting.priority:
            return max(self.running)
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(req)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chosen: dict[str, tuple[Request, int]] = {}
        preempted: list[str] = []

        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens_with_spec - req.num_computed_tokens, budget,
                    self.max_model_len - req.num_computed_tokens)
            if n <= 0:
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self._victim()
                if victim.request_id in chosen:  # scheduled earlier in this step: give its budget back
                    budget += chosen.pop(victim.request_id)[1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status == RequestStatus.RUNNING:
                chosen[req.request_id] = (req, n)
                budget -= n

        while not preempted and budget > 0 and len(self.waiting) and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            hits, n_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - n_hit, budget)
            if not self.kv.allocate_slots(req, n, hits):
                break
            self.waiting.pop()
            self.kv.record_lookup(req.num_tokens, n_hit)
            req.num_computed_tokens = n_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = n_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chosen[req.request_id] = (req, n)
            budget -= n

        out = SchedulerOutput(preempted=preempted)
        for req, n in chosen.values():
            start = req.num_computed_tokens
            tokens = req.all_token_ids[start:start + n] if start + n <= req.num_tokens else \
                (req.all_token_ids + req.spec_token_ids)[start:start + n]
            num_logits = max(0, start + n - req.num_tokens + 1)
            out.scheduled.append(ScheduledRequest(req.request_id, tokens, start,
                                                  self.kv.get_block_ids(req.request_id), num_logits))
            out.num_batched_tokens += n
        return out

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The runner has computed the scheduled tokens: advance each request's computed count."""
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is not None:
                req.num_computed_tokens = s.start_pos + len(s.token_ids)
