"""The scheduler's queue of requests waiting for a place in the running batch."""

from __future__ import annotations

import bisect
from collections import deque

from llmopt.core.request import Request
from llmopt.errors import UserInputError

POLICIES = ("fcfs", "priority")


class WaitingQueue:
    """FCFS: a deque (preempted requests go back to the front). Priority: kept sorted (lower
    value first, then arrival)."""

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

    def __contains__(self, req: Request) -> bool:
        return req in self._q

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(list(self._q))
