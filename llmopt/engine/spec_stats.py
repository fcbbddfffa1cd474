"""Speculative decoding's counters (vLLM's spec_decode_num_drafts, _num_draft_tokens,
_num_accepted_tokens, _num_accepted_tokens_per_pos): the engine records them after each step from
the scheduled drafts and the sampled tokens; `LLMEngine.stats().spec_decoding` hands out a copy.
`llmopt spec-tune` measures acceptance through that copy."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmopt.core.sampler import SampledTokens
from llmopt.core.scheduler import SchedulerOutput


@dataclass
class SpecDecodingStats:
    """Counters since the engine started."""
    method: str
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens each verifying step yields per request."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def acceptance_rate_per_pos(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.num_accepted_tokens_per_pos]

    def copy(self) -> "SpecDecodingStats":
        return SpecDecodingStats(self.method, self.num_speculative_tokens, self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos))

    def record(self, sched: SchedulerOutput, sampled: dict[str, SampledTokens]) -> None:
        """Count one step's drafts and how many of each were accepted (leading drafts equal to the
        token their row chose)."""
        for s in sched.scheduled:
            drafts = s.spec_token_ids
            got = sampled.get(s.request_id)
            if not drafts or got is None:
                continue
            a = 0
            while a < len(drafts) and a < len(got.token_ids) and got.token_ids[a] == drafts[a]:
                a += 1
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += a
            for j in range(a):
                self.num_accepted_tokens_per_pos[j] += 1
