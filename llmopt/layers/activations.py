"""W8A8's activation quantization, per token, dynamic and symmetric, as vLLM computes it: the one
definition that the runtime modules (`layers/modules_w8a8.py`) run and that calibration's error
report (`quant/layerwise.py`) simulates as dequantize(quantize(x)).

  fp8:  s = max(amax|x| / 448, 1 / (448 * 512)),  codes = fp8_e4m3(clamp(x / s, ±448))
  int8: s = amax|x| / 127 (an all-zero row: 1),   codes = clamp(round(x / s), -128, 127)
Scales are float32 [rows, 1]; x is [..., K] with tokens along the leading dims.
"""

from __future__ import annotations

import torch

from llmopt.errors import UserInputError

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)   # 448
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)                 # vLLM's floor for a per-token fp8 scale
KINDS = ("fp8", "int8")


def quantize_tokens_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (float8_e4m3fn codes [..., K], float32 scales [..., 1])."""
    s = (x.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def quantize_tokens_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (int8 codes [..., K], float32 scales [..., 1]); an all-zero row gets scale 1."""
    amax = x.abs().amax(-1, keepdim=True).float()
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(x.float() / s).clamp(-128, 127).to(torch.int8), s


def quantize_tokens(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "fp8":
        return quantize_tokens_fp8(x)
    if kind == "int8":
        return quantize_tokens_int8(x)
    raise UserInputError(f"unknown activation format {kind!r}: use fp8 or int8")


def dequantize_tokens(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scales).to(dtype)


def fake_quantize_tokens(x: torch.Tensor, kind: str) -> torch.Tensor:
    """What a W8A8 Linear does to its input, in x's dtype: dequantize(quantize(x))."""
    return dequantize_tokens(*quantize_tokens(x, kind), x.dtype)
