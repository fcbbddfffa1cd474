"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's field names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmopt import defaults
from llmopt.errors import UserInputError
from llmopt.structured.params import StructuredOutputsParams
from llmopt.validate import SEED_MAX, SEED_MIN


@dataclass
class SamplingParams:
    n: int = 1                            # completions per prompt (they share the prompt's blocks)
    temperature: float = 1.0              # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                        # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None               # per-request generator: same seed, same tokens
    presence_penalty: float = 0.0         # OpenAI: subtracted once per token seen in the output
    frequency_penalty: float = 0.0        # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0       # HF/CTRL: prompt and output tokens, divide (>0) or multiply
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16           # None = up to max_model_len
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None           # number of top logprobs per output token (0 = sampled only)
    prompt_logprobs: int | None = None    # the same per prompt token (vLLM's; the first token has none)
    # with prompt_logprobs: the first prompt position scored (SGLang's logprob_start_len); the ones
    # before it are None and may come from the prefix cache (a scored position is always computed)
    prompt_logprobs_start: int = 0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | dict | None = None  # vLLM's: json, regex, choice, grammar, ...
    logit_bias: dict[int, float] | None = None      # token id -> added to its logit, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None      # only these may be sampled
    bad_words: list[str] = field(default_factory=list)  # words that may not be generated (vLLM's)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.top_k == -1:
            self.top_k = 0
        self.bad_words = list(self.bad_words or [])
        if self.logit_bias is not None:
            bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            if not all(math.isfinite(v) for v in bias.values()):
                raise UserInputError("logit_bias values must be finite numbers")
            self.logit_bias = {k: min(max(v, -100.0), 100.0) for k, v in bias.items()} or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        checks = [
            (self.n >= 1, "n must be at least 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0 (0 or -1 = off)"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens must be <= max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= defaults.MAX_LOGPROBS,
             f"logprobs must be in [0, {defaults.MAX_LOGPROBS}] (vLLM's max_logprobs), got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= defaults.MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {defaults.MAX_LOGPROBS}] (vLLM's max_logprobs), got {self.prompt_logprobs}"),
            (self.prompt_logprobs_start >= 0, f"prompt_logprobs_start must be >= 0, got {self.prompt_logprobs_start}"),
            (self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, f"seed must fit in 64 bits "
             f"([{SEED_MIN}, {SEED_MAX}]), got {self.seed}"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (all(w.strip() for w in self.bad_words), "bad_words must not be empty or blank"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserInputError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
