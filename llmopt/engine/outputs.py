"""What the engine hands back: one RequestOutput per prompt, with one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmopt.engine.request import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None       # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None   # the stop token id or stop string that ended it

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
    metrics: dict = field(default_factory=dict)
