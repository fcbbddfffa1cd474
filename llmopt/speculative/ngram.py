"""N-gram (prompt lookup) drafting: find the most recent earlier occurrence of the request's last n
tokens (n from prompt_lookup_max down to prompt_lookup_min) in its prompt and output, and propose
the tokens that followed it. No model, no KV."""

from __future__ import annotations

import numpy as np


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
