"""Log-probabilities of given tokens at given hidden rows, computed `defaults.LOSS_CHUNK_TOKENS` rows
of logits at a time: never a float32 [rows, vocab] tensor for a whole prompt. The one scoring
primitive of eval-ppl (eval/score.py) and of prompt logprobs (the runner, vLLM's `prompt_logprobs`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt import defaults


@dataclass
class ScoredTokens:
    """Per row: log p(target), the target's rank (1 = the most likely token) and the top-k."""
    logprobs: torch.Tensor       # float32 [m]
    ranks: torch.Tensor | None   # int64 [m] (None: not asked)
    top_ids: torch.Tensor        # int64 [m, k]
    top_logprobs: torch.Tensor   # float32 [m, k]


def score_tokens(model, hidden: torch.Tensor, targets: torch.Tensor, k: int = 0, ranks: bool = True,
                 chunk: int = defaults.LOSS_CHUNK_TOKENS) -> ScoredTokens:
    """Score `targets[i]` under the model's logits at `hidden[i]` (`model.compute_logits`, float32,
    log-softmax over the whole vocabulary), with the `k` most likely tokens of each row and, with
    `ranks`, the target's rank (one more pass over the logits)."""
    m = hidden.shape[0]
    targets = targets.to(hidden.device).long()
    lp = torch.empty(m, dtype=torch.float32, device=hidden.device)
    rank = torch.empty(m, dtype=torch.long, device=hidden.device) if ranks else None
    top_ids = torch.empty(m, k, dtype=torch.long, device=hidden.device)
    top_lp = torch.empty(m, k, dtype=torch.float32, device=hidden.device)
    for a in range(0, m, chunk):
        logits = model.compute_logits(hidden[a:a + chunk]).float()
        norm = torch.logsumexp(logits, dim=-1, keepdim=True)
        target_logit = logits.gather(-1, targets[a:a + chunk, None])
        lp[a:a + chunk] = (target_logit - norm)[:, 0]
        if rank is not None:
            rank[a:a + chunk] = (logits > target_logit).sum(-1) + 1
        if k:
            v, i = logits.topk(k, dim=-1)
            top_ids[a:a + chunk], top_lp[a:a + chunk] = i, v - norm
        del logits
    return ScoredTokens(lp, rank, top_ids, top_lp)
