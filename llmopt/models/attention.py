"""Attention contexts: what a model's forward is given besides token ids and positions.

The model calls `ctx(layer_idx, q, k, v, window)` in each layer, with q of shape
[..., num_heads, head_dim] and k, v of shape [..., num_kv_heads, head_dim] (same leading shape as
the token ids), and gets back [..., num_heads, head_dim]. Two families implement it:

- `DenseCausalAttention` (here): no KV cache; the ids are a [batch, seq] block and each row attends
  causally to itself. Used by eval-ppl, calibration and tests.
- the engine's paged attention (llmopt/engine): flattened tokens of many requests, K/V written into
  and read from paged cache blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DenseCausalAttention:
    """Causal self-attention over a [batch, seq] block, with an optional sliding window per layer.
    The queries may be a suffix of the keys' positions (fewer queries than keys: the last ones)."""

    supports_query_suffix = True

    def __init__(self) -> None:
        self._masks: dict[tuple, torch.Tensor] = {}

    def _mask(self, tq: int, tk: int, window: int | None, device) -> torch.Tensor:
        key = (tq, tk, window, str(device))
        if key not in self._masks:
            i = torch.arange(tk - tq, tk, device=device)   # the queries' positions
            d = i[:, None] - torch.arange(tk, device=device)[None, :]
            m = d >= 0
            if window is not None:
                m &= d < window                                # q - kv < window, as transformers masks it
            self._masks[key] = m
        return self._masks[key]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 window: int | None) -> torch.Tensor:
        # [B, T, H, D] -> [B, H, T, D]
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        tq, t = q.shape[-2], k.shape[-2]
        gqa = q.shape[1] != k.shape[1]
        if tq != t or (window is not None and window < t):
            mask = self._mask(tq, t, window if window is not None and window < t else None, q.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return o.transpose(1, 2)
