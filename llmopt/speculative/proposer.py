"""The proposer for a SpeculativeConfig: n-gram prompt lookup (ngram.py), a draft model
(draft_model.py) or an EAGLE / EAGLE-3 head (eagle.py), each a `llmopt.speculative.interface.Proposer`.
The engine calls `build_proposer` once, at construction, when its args carry a speculative config."""

from __future__ import annotations

from llmopt.speculative.interface import Proposer, ProposerContext
from llmopt.models.loader import load_model
from llmopt.speculative.config import SpeculativeConfig
from llmopt.speculative.draft_model import DraftModelProposer
from llmopt.speculative.eagle import EagleProposer
from llmopt.speculative.ngram import NgramProposer


def build_proposer(config: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "draft_model":
        draft = load_model(config.model, ctx.dtype, str(ctx.target.device), tokenizer=False)
        return DraftModelProposer(config, draft, ctx)
    return EagleProposer(config, ctx)
