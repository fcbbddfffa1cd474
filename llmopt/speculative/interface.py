"""The proposer: what drafts tokens for the engine to verify (speculative decoding), as vLLM v1's
spec_decode proposers. Implementations live in llmopt/speculative (n-gram, draft model, EAGLE) and
import these types; the engine holds one `Proposer` or None and calls only what it names.

Per step, before scheduling, the engine asks the scheduler how many drafts each decoding request
may verify (`Scheduler.schedule_lookahead`: K for the batch, capped by the request's room; the
scheduler allocates the lookahead slots a proposer that `writes_kv` fills), then calls
`propose(ProposeInput)` and hands the drafts to the scheduler, which schedules them for
verification, keeps the accepted ones and rewinds the rest (`update_from_output`). A proposer owns
no blocks: it reads block tables, it never allocates or frees.

After each step a proposer with `hidden_layers` (not None) gets the target's hidden states of
that step (`observe`): the runner returns them because the scheduler's output asks for them
(`SchedulerOutput.hidden_layers`), for the whole life of the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

import torch

from llmopt.core.request import Request
from llmopt.worker.runner import HiddenStates
from llmopt.models.loader import LoadedModel


class DraftConfig(Protocol):
    """What the engine reads of a speculative config (llmopt.speculative.config.SpeculativeConfig)."""
    method: str
    num_speculative_tokens: int

    def num_tokens_for_batch(self, batch_size: int) -> int: ...


@dataclass
class ProposerContext:
    """What a proposer is built with, once: the target and the shape of its KV cache."""
    target: LoadedModel      # the target model (embedding, LM head, config, dtype, device)
    dtype: str               # the engine's --dtype (a draft model loads in it)
    num_blocks: int          # the target's KV blocks: a proposer's own KV lives over the same block table
    block_size: int
    backend: str             # kernel backend of the target's runner, "torch" or "triton"


@dataclass
class ProposeInput:
    """One step's drafting: the decoding requests (their token ids are `all_token_ids`; the first
    draft goes at position `num_tokens`), how many drafts each may have, and block tables."""
    requests: list[Request]
    num_draft_tokens: dict[str, int]     # request id -> at most this many drafts (>= 1)
    block_ids: dict[str, list[int]]      # request id -> its block table, lookahead slots included


@dataclass
class DraftProposal:
    token_ids: dict[str, list[int]] = field(default_factory=dict)   # request id -> drafts (absent or []: none)
    # request id -> [k, vocab] the distribution each draft was drawn from (rejection sampling's q);
    # absent: the drafts were chosen deterministically (greedy), as every proposer here does
    probs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class StepHiddenStates:
    """The target's hidden states of one step and whose rows they are."""
    rows: list[tuple[str, int, int]]     # (request id, position of its first row, number of rows), row order
    states: HiddenStates


class Proposer(ABC):
    """A drafter for a SpeculativeConfig (`method`, K per batch size)."""
    hidden_layers: tuple[int, ...] | None = None   # what observe() gets: None nothing, () final states, + layers' inputs
    writes_kv: bool = False                         # drafting writes K/V over the request's block table

    def __init__(self, config: DraftConfig) -> None:
        self.config = config

    @property
    def method(self) -> str:
        return self.config.method

    def num_draft_tokens(self, batch_size: int) -> int:
        """K for a batch of `batch_size` running requests (0: no drafting)."""
        return self.config.num_tokens_for_batch(batch_size)

    @abstractmethod
    def propose(self, batch: ProposeInput) -> DraftProposal:
        """Drafts for the requests of `batch`, at most `num_draft_tokens` each."""

    def observe(self, hidden: StepHiddenStates | None) -> None:
        """After each step (only when `hidden_layers` is not None): the target's hidden states, or
        None when the step's were lost (it was rerun request by request)."""

    def forget(self, live: Collection[str]) -> None:
        """Drop what is kept for requests not in `live` (finished or aborted)."""
