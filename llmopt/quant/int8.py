"""INT8 weights, symmetric per output channel (W ≈ w8·s, s = absmax / 127), weight-only or W8A8
with dynamic per-token activation scales; for W8A8, SmoothQuant (Xiao et al., 2023) first moves
activation outliers into the weights: s_j = max|X_j|^α / max|W_j|^(1−α), folded into the norm."""

from __future__ import annotations

import torch
import torch.nn as nn

from llmopt.quant.awq import fold_scales
from llmopt.quant.rtn import round_scale
from llmopt.quant.types import Int8Quantized


def quantize_int8(w: torch.Tensor, activations: str = "dynamic", bias: torch.Tensor | None = None,
                  scale_dtype: torch.dtype | None = None) -> Int8Quantized:
    w = w.float()
    scale = round_scale((w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12), scale_dtype)
    w8 = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return Int8Quantized(weight=w8, weight_scale=scale, activations=activations, bias=bias)


def smoothing_scales(act_absmax: torch.Tensor, linears: list[nn.Linear], alpha: float) -> torch.Tensor:
    """Per-input-channel divisor s: activations ÷ s, weight columns × s."""
    w_absmax = torch.cat([lin.weight.detach().abs().float() for lin in linears], dim=0).amax(dim=0)
    s = act_absmax.float().clamp(min=1e-5).pow(alpha) / w_absmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


@torch.no_grad()
def smooth(norm: nn.Module, linears: list[nn.Linear], act_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """Fold SmoothQuant's scales into `norm` and `linears` (the float function is unchanged)."""
    s = smoothing_scales(act_absmax, linears, alpha)
    fold_scales(norm, linears, s)
    return s
