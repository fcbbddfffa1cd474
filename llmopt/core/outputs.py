"""What the engine hands back: one RequestOutput per prompt, with one CompletionOutput per sample,
its per-token logprobs and its timing (RequestMetrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Logprob of the chosen token and the top alternatives at one output (or prompt) position."""
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
    rank: int | None = None        # of the token among the vocabulary (1 = the most likely); prompt tokens


@dataclass
class RequestMetrics:
    """Timestamps of one request (time.monotonic() seconds), as vLLM's RequestMetrics.
    first_scheduled: admitted to the running batch; first_token: its first output token sampled;
    finished: stopped, hit its length limit or was aborted. None: not yet. token_times: when each
    output token was sampled, one entry per token (tokens of one step share it)."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def last_token_time(self) -> float | None:
        return self.token_times[-1] if self.token_times else None

    # vLLM's request phases (v1/metrics/stats.py), preemptions included; None until the tokens exist:
    # prefill = first scheduled -> first token, decode = first token -> last token, inference = both
    @property
    def prefill_time(self) -> float | None:
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def inference_time(self) -> float | None:
        if self.first_scheduled_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_scheduled_time

    @staticmethod
    def merge(parts: list["RequestMetrics"]) -> "RequestMetrics":
        """One prompt's metrics from its n samples': first arrival, schedule and token; last finish
        (None until every sample is finished)."""
        def first(xs):
            xs = [x for x in xs if x is not None]
            return min(xs) if xs else None
        finished = [m.finished_time for m in parts]
        return RequestMetrics(min(m.arrival_time for m in parts), first(m.first_scheduled_time for m in parts),
                              first(m.first_token_time for m in parts),
                              None if None in finished else max(finished),
                              sorted(t for m in parts for t in m.token_times))


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None       # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None   # the stop token id or stop string that ended it
    # this sample's own timing once it has finished (None while it runs); RequestOutput.metrics merges them
    metrics: RequestMetrics | None = field(default=None, compare=False, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0             # prompt tokens served by the prefix cache
    metrics: RequestMetrics | None = None
    error: str | None = None               # why the engine failed this prompt (finish_reason "error")
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
