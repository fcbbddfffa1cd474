"""Activation quantization: the one definition that the runtime modules run and that calibration's
error report (`quant/layerwise.py`) simulates as dequantize(quantize(x)).

W8A8 (`layers/modules_w8a8.py`), per token, dynamic and symmetric, as vLLM computes it:
  fp8:  s = max(amax|x| / 448, 1 / (448 * 512)),  codes = fp8_e4m3(clamp(x / s, ±448))
  int8: s = amax|x| / 127 (an all-zero row: 1),   codes = clamp(round(x / s), -128, 127)
Scales are float32 [rows, 1]; x is [..., K] with tokens along the leading dims.

W4A4 (`layers/modules_fp4.py`), per row and block of consecutive columns, dynamic, as
compressed-tensors' fake quantization computes it (its NVFP4 and MXFP4 presets' input_activations),
emulated: x' = E2M1(clamp(x / s, ±6)) * s, E2M1 rounding half to even, s per block from its amax
(computed in x's dtype, as theirs):
  nvfp4 (blocks of 16, a static float32 global scale g): s = E4M3(clamp(g * (amax / 6), ±448)) / g,
        a zero E4M3 scale 0.125 / g; x / s and the product in float32;
  mxfp4 (blocks of 32): s = 2 ** (clamp(floor(log2 amax') - 2 + 127, 0, 255) - 127) in x's dtype
        (a zero there: 1), amax' amax rounded up to the next power of two when its significand is >=
        1.75 (a subnormal one: to x's smallest normal from 0.75 of it, else to 0); x / s and the
        product in x's dtype.
"""

from __future__ import annotations

import math

import torch

from llmopt.errors import UserInputError

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)   # 448
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)                 # vLLM's floor for a per-token fp8 scale
KINDS = ("fp8", "int8")
FP4_KINDS = {"nvfp4": 16, "mxfp4": 32}   # W4A4 activations -> block size


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


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """The E2M1 value nearest to clamp(y, ±6), ties to even, in y's dtype; a negative y rounding to 0
    gives -0.0 (compressed-tensors' cast_to_fp4). E2M1's steps are 0.5 below 2, 1 below 4 and 2 up
    to 6, so each range is torch.round (half to even) at its step: the even E2M1 mantissa wins a tie."""
    a = y.abs().float().clamp_(max=6.0)
    q = torch.where(a < 2, torch.round(a * 2) * 0.5, torch.where(a < 4, torch.round(a), torch.round(a * 0.5) * 2))
    return torch.where(y < 0, -q, q).to(y.dtype)


def fake_quantize_fp4(x: torch.Tensor, kind: str, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """What a W4A4 Linear does to its input x [..., K] (K a multiple of the block), in x's dtype:
    dequantize(quantize(x)) by the module docstring's rules; `global_scale` (float32 [1]): nvfp4's."""
    if kind not in FP4_KINDS:
        raise UserInputError(f"unknown FP4 activation format {kind!r}: use {' or '.join(FP4_KINDS)}")
    b = x.unflatten(-1, (-1, FP4_KINDS[kind]))
    amax = b.abs().amax(-1, keepdim=True)
    if kind == "nvfp4":
        g = global_scale.to(torch.float32).reshape(1)
        s = (g * (amax / 6.0)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
        s = torch.where(s == 0, 0.125, s) / g
        return (round_e2m1(b / s) * s).flatten(-2).to(x.dtype)
    a = amax.float()
    m, e = torch.frexp(a)                              # a = m * 2 ** e, m in [0.5, 1)
    e = e - 1 + (m >= 0.875).to(e.dtype)               # floor(log2 amax')
    tiny = torch.finfo(x.dtype).tiny                   # amax subnormal in x's dtype: amax' is tiny or 0
    low = torch.where(a >= 0.75 * tiny, math.frexp(tiny)[1] - 1, -(1 << 16)).to(e.dtype)
    e = (torch.where(a < tiny, low, e) - 2 + 127).clamp(0, 255)
    s = torch.ldexp(torch.ones_like(a), e - 127).to(x.dtype)
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (round_e2m1(b / s) * s).flatten(-2)
