"""Round-to-nearest group quantization: the baseline, and the quantizer GPTQ and AWQ call.

Conventions (those of GPTQ, which AutoAWQ and compressed-tensors unpack to the same W ≈ (q - z)·s):
- asymmetric: the group's range [min(w, 0), max(w, 0)] is split into 2**bits - 1 steps,
  z = round(-min / s) in [0, 2**bits);
- symmetric: s = 2·absmax / (2**bits - 1), z = 2**(bits - 1) (the middle code).
"""

from __future__ import annotations

import torch

from llmopt.errors import UserInputError
from llmopt.layers.types import IntQuantized, round_scale


def check_group_size(in_features: int, group_size: int, name: str = "weight") -> int:
    """The effective group size (in_features for -1); a clear error when it does not divide."""
    if group_size == -1:
        return in_features
    if group_size <= 0 or in_features % group_size:
        raise UserInputError(f"--group-size {group_size} does not divide {name}'s {in_features} input features: "
                             f"use a divisor such as {largest_divisor(in_features)} or -1 (one group per row)")
    return group_size


def largest_divisor(n: int) -> int:
    for g in (128, 64, 32, 16):
        if n % g == 0:
            return g
    return n


def group_params(w: torch.Tensor, bits: int, sym: bool,
                 scale_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each row of w [rows, group] (reduced over the last dim): [rows, 1] each."""
    maxq = 2 ** bits - 1
    w = w.float()
    if sym:
        amax = w.abs().amax(dim=-1, keepdim=True)
        scale = 2 * amax / maxq
        zero = torch.full_like(scale, float(2 ** (bits - 1)))
    else:
        lo = w.amin(dim=-1, keepdim=True).clamp(max=0)
        hi = w.amax(dim=-1, keepdim=True).clamp(min=0)
        scale = (hi - lo) / maxq
        zero = torch.round(-lo / torch.where(scale == 0, torch.ones_like(scale), scale))
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero group: any scale is exact
    if scale_dtype is not None and scale_dtype != torch.float32:
        scale = round_scale(scale, scale_dtype)
        if not sym:
            zero = torch.clamp(torch.round(-lo / scale), 0, maxq)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.clamp(torch.round(w.float() / scale) + zero, 0, 2 ** bits - 1)


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool,
                 bias: torch.Tensor | None = None, scale_dtype: torch.dtype | None = None) -> IntQuantized:
    """W [out, in] → IntQuantized with per-(row, group) scales and zero points."""
    out_f, in_f = w.shape
    gs = check_group_size(in_f, group_size)
    wg = w.float().reshape(out_f, in_f // gs, gs)
    scale, zero = group_params(wg, bits, sym, scale_dtype)       # [out, groups, 1]
    q = quantize_codes(wg, scale, zero, bits).reshape(out_f, in_f)
    return IntQuantized(qweight=q.to(torch.int32), scales=scale.squeeze(-1), zeros=zero.squeeze(-1).to(torch.int32),
                        bits=bits, group_size=group_size, sym=sym, bias=bias)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool,
                  scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Quantize and dequantize in one go (the AWQ searches' inner loop), in w's dtype."""
    out_f, in_f = w.shape
    gs = in_f if group_size == -1 else group_size
    wg = w.float().reshape(out_f, in_f // gs, gs)
    scale, zero = group_params(wg, bits, sym, scale_dtype)
    return ((quantize_codes(wg, scale, zero, bits) - zero) * scale).reshape(out_f, in_f).to(w.dtype)
