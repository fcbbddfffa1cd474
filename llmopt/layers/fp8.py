"""FP8 e4m3 weights with per-tensor or per-output-channel scales (W ≈ w8·s, s = absmax / 448),
weight-only or W8A8 with dynamic per-token activation scales (layers/activations.py, applied at run
time): what `quantize --method fp8` writes and `--quantization fp8` runs at load time."""

from __future__ import annotations

import torch

from llmopt.errors import UserInputError
from llmopt.layers.activations import FP8_MAX
from llmopt.layers.types import FloatQuantized, round_scale


def quantize_fp8(w: torch.Tensor, scheme: str = "channel", activations: str = "dynamic",
                 bias: torch.Tensor | None = None, scale_dtype: torch.dtype | None = None) -> FloatQuantized:
    w = w.float()
    if scheme == "channel":
        amax = w.abs().amax(dim=1, keepdim=True)
    elif scheme == "tensor":
        amax = w.abs().amax().reshape(1)
    else:
        raise UserInputError(f"unknown FP8 weight scale scheme {scheme!r}: use channel or tensor")
    scale = round_scale((amax / FP8_MAX).clamp(min=1e-12), scale_dtype)
    w8 = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return FloatQuantized(weight=w8, weight_scale=scale.to(torch.float32), activations=activations, bias=bias)
