"""A request as the scheduler and engine track it: tokens, progress, status, and its outputs."""

from __future__ import annotations

import enum
import time

import torch

from llmopt.core.outputs import RequestMetrics, TokenLogprobs
from llmopt.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"      # the engine failed on this request alone (Request.error says how)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


def max_tokens_limit(params: SamplingParams, prompt_len: int, max_model_len: int | None) -> int:
    """The most tokens a sample may generate: max_tokens (None: up to the context), within the context."""
    limit = params.max_tokens if params.max_tokens is not None else (max_model_len or 1 << 30) - prompt_len
    if max_model_len is not None:
        limit = min(limit, max_model_len - prompt_len)
    return max(limit, 0)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(), max_model_len: int | None = None,
                 prompt: str | None = None, priority: int = 0, arrival_time: float | None = None,
                 parent_id: str | None = None, index: int = 0, detokenizer=None, grammar=None,
                 bad_words: list[list[int]] | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.priority = priority
        self.metrics = RequestMetrics(time.monotonic() if arrival_time is None else arrival_time)
        self.parent_id = parent_id or request_id
        self.index = index
        self.status = RequestStatus.WAITING
        self._all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.spec_token_ids: list[int] = []      # draft tokens to verify in the next step
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1              # prefix-cache hit at first schedule (-1: not yet)
        self.num_preemptions = 0
        self.max_tokens = max_tokens_limit(params, len(prompt_token_ids), max_model_len)
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        # one entry per prompt token scored so far (the first has none): filled chunk by chunk, once
        # (and None for the positions before params.prompt_logprobs_start, which are never scored)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * min(max(1, params.prompt_logprobs_start), len(prompt_token_ids))
        self.cumulative_logprob = 0.0
        self.stop_reason: int | str | None = None
        self.error: str | None = None            # why it finished with FINISHED_ERROR
        self.detokenizer = detokenizer           # an IncrementalDetokenizer, or None (token ids only)
        self.grammar = grammar                   # a structured.backend.RequestGrammar (structured outputs)
        self.bad_words = bad_words or []         # params.bad_words as token-id sequences
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed)

    # -- tokens ------------------------------------------------------------------------------------
    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    def append_output_token(self, token_id: int, logprob: float | None = None,
                            top: dict[int, float] | None = None) -> str:
        """Add one accepted output token (and its logprobs when the request asked for them);
        returns the text it added ("" without a detokenizer)."""
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if self.grammar is not None and not self.grammar.accept([token_id]):
            raise RuntimeError(f"token {token_id} breaks the request's structured-output grammar")
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(TokenLogprobs(token_id, logprob, dict(top or {})))
            self.cumulative_logprob += logprob
        return self.detokenizer.add([token_id]) if self.detokenizer is not None else ""

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    @property
    def blocked_token_ids(self) -> frozenset[int]:
        """Tokens that may not be sampled yet (EOS and stop ids until min_tokens are out)."""
        if len(self.output_token_ids) >= self.params.min_tokens:
            return frozenset()
        return self.eos_token_ids | self.stop_token_ids

    def __lt__(self, other: "Request") -> bool:  # priority queue order: priority, then arrival
        return (self.priority, self.arrival_time) < (other.priority, other.arrival_time)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
