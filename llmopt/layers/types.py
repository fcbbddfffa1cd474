"""The canonical form of a quantized linear weight, between the algorithms (llmopt.quant, which
produce it) and the checkpoint formats / runtime modules (which pack, unpack and run it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class IntQuantized:
    """Integer group quantization of a Linear weight W [out, in]: W ≈ (q - z) * s.

    qweight: [out, in] int32 codes in [0, 2**bits).
    scales:  [out, n_groups] float (n_groups = in // group_size; 1 when group_size == -1).
    zeros:   [out, n_groups] int32 codes; for symmetric quantization they are all 2**(bits-1).
    g_idx:   [in] int32 group of each input column (act-order GPTQ); None means column // group_size.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    sym: bool
    g_idx: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def group_index(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx.long()
        gs = self.in_features if self.group_size == -1 else self.group_size
        return torch.arange(self.in_features, device=self.qweight.device) // gs

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self.group_index()
        s = self.scales.to(torch.float32)[:, g]
        z = self.zeros.to(torch.float32)[:, g]
        return ((self.qweight.to(torch.float32) - z) * s).to(dtype)


@dataclass
class FloatQuantized:
    """FP8 (e4m3) weight with a per-tensor ([1]) or per-channel ([out, 1]) scale: W ≈ w8 * s.
    `activations` is "none" (weight-only) or "dynamic" (W8A8, per-token activation scales)."""

    weight: torch.Tensor          # [out, in] torch.float8_e4m3fn
    weight_scale: torch.Tensor    # float32, [1] or [out, 1]
    activations: str = "none"
    bias: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.to(torch.float32) * self.weight_scale.to(torch.float32)).to(dtype)


@dataclass
class Int8Quantized:
    """Symmetric INT8 weight, per output channel: W ≈ w8 * s, w8 in [-127, 127].
    `activations` is "none" (weight-only) or "dynamic" (W8A8, per-token activation scales).
    `smooth` is the SmoothQuant per-input-channel divisor already folded into the previous op."""

    weight: torch.Tensor          # [out, in] int8
    weight_scale: torch.Tensor    # [out, 1] float32
    activations: str = "dynamic"
    bias: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.to(torch.float32) * self.weight_scale.to(torch.float32)).to(dtype)


def round_scale(scale: torch.Tensor, scale_dtype: torch.dtype | None) -> torch.Tensor:
    """Scales as the checkpoint will store them (e.g. fp16), so codes are chosen against those."""
    if scale_dtype is None or scale_dtype == torch.float32:
        return scale
    tiny = torch.finfo(scale_dtype).tiny
    return scale.clamp(min=tiny).to(scale_dtype).float()
