"""INT8 weights, symmetric per output channel (W ≈ w8·s, s = absmax / 127), weight-only or W8A8
with dynamic per-token activation scales: what `quantize --method int8` writes (after SmoothQuant,
llmopt/quant/smoothquant.py, for W8A8) and `--quantization int8` runs at load time."""

from __future__ import annotations

import torch

from llmopt.layers.types import Int8Quantized, round_scale


def quantize_int8(w: torch.Tensor, activations: str = "dynamic", bias: torch.Tensor | None = None,
                  scale_dtype: torch.dtype | None = None) -> Int8Quantized:
    w = w.float()
    scale = round_scale((w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12), scale_dtype)
    w8 = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return Int8Quantized(weight=w8, weight_scale=scale, activations=activations, bias=bias)
