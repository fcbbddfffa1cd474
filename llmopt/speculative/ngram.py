"""N-gram (prompt lookup) drafting: find the most recent earlier occurrence of the request's last n
tokens (n from prompt_lookup_max down to prompt_lookup_min) in its prompt and output, and propose
the tokens that followed it. No model, no KV."""

from __future__ import annotations

import numpy as np

from llmopt.speculative.interface import DraftConfig, DraftProposal, ProposeInput, Proposer


def ngram_propose(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens following the latest earlier match of the longest suffix n-gram (n in
    [n_min, n_max]); [] when no suffix of those lengths occurred before."""
    L = len(tokens)
    if k < 1 or L < n_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = arr[L - n:]
        # windows starting at i < L - n (an earlier occurrence, possibly overlapping the suffix)
        hay = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)
        hits = np.flatnonzero((hay == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    """Prompt lookup as a Proposer: no model, no K/V, no hidden states."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__(config)
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, batch: ProposeInput) -> DraftProposal:
        out = DraftProposal()
        for r in batch.requests:
            d = ngram_propose(r.all_token_ids, batch.num_draft_tokens[r.request_id], self.n_min, self.n_max)
            if d:
                out.token_ids[r.request_id] = d
        return out
