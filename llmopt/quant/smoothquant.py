"""SmoothQuant (Xiao et al., 2023) for INT8 W8A8: before the weights are quantized
(llmopt.layers.int8), activation outliers move into them: s_j = max|X_j|^α / max|W_j|^(1−α), folded
into the norm before the Linears (the float function is unchanged)."""

from __future__ import annotations

import torch
import torch.nn as nn

from llmopt.quant.awq import fold_scales


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
