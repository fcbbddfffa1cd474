"""Quality of a quantized checkpoint against its source: perplexity before and after, KL divergence
and top-1 agreement, in one pass (eval-ppl chunks on WikiText-2 test; what `quantize --eval` reports)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from llmopt import defaults
from llmopt.eval import load_text_dataset, plan_ppl, run_ppl
from llmopt.models.loader import load_model


@dataclass
class QuantEval:
    perplexity_before: float     # the source checkpoint
    perplexity_after: float      # the quantized checkpoint, same windows
    kld_mean: float              # mean KL(source || quantized) per scored token
    top1_agreement: float        # share of scored tokens with the same argmax
    scored_tokens: int
    dataset: str
    method: str
    window: int


@dataclass
class QuantEvalPlan:
    base: Any          # LoadedModel of the source
    quantized: Any     # LoadedModel of the quantized checkpoint
    ppl: Any           # llmopt.eval.PplPlan

    @property
    def windows(self) -> int:
        return len(self.ppl.windows)


def plan_quant_eval(base: str, quantized: str, *, dataset: str = defaults.PPL_DATASET,
                    limit: int | None = defaults.QUANT_EVAL_LIMIT, ctx: int = defaults.PPL_CTX,
                    dtype: str = "auto", device: str = "auto") -> QuantEvalPlan:
    """Load both checkpoints and plan the chunks windows (the first `limit` tokens of `dataset`)."""
    data = load_text_dataset(dataset)
    base_lm = load_model(base, dtype, device)
    q_lm = load_model(quantized, dtype, device)
    mpe = base_lm.config.max_position_embeddings
    plan = plan_ppl(base_lm.tokenizer, mpe, data, "chunks", ctx=min(ctx, mpe), limit=limit)
    return QuantEvalPlan(base=base_lm, quantized=q_lm, ppl=plan)


def run_quant_eval(plan: QuantEvalPlan, progress: Callable[[int], None] | None = None) -> QuantEval:
    """Score the quantized model with KLD against the source; progress(n) after each n windows."""
    r = run_ppl(plan.quantized, plan.ppl, base=plan.base, progress=progress)
    return QuantEval(perplexity_before=r.kl.base_ppl, perplexity_after=r.ppl, kld_mean=r.kl.kld_mean,
                     top1_agreement=r.kl.top1_agreement, scored_tokens=r.scored_tokens, dataset=r.dataset,
                     method=r.method, window=r.window)


def evaluate_quantized(base: str, quantized: str, *, progress: Callable[[int], None] | None = None,
                       **plan_kwargs: Any) -> QuantEval:
    """plan_quant_eval then run_quant_eval, for callers that need no progress total."""
    return run_quant_eval(plan_quant_eval(base, quantized, **plan_kwargs), progress=progress)
