"""NVFP4 and MXFP4 weight quantization: round to nearest, or GPTQ's error feedback (as llm-compressor
offers both), into the stored forms of llmopt.layers.formats.fp4 (Nvfp4Quantized, Mxfp4Quantized).

Each value becomes the E2M1 code nearest to w / s (|w / s| clamped to 6), s its block's effective
scale. The scales and the rounding follow the reference implementation of the format written:
- NVFP4 (compressed-tensors' NVFP4A16, llm-compressor): global = 448 * 6 / amax(W) in float32 (a
  non-finite one 1; nvfp4_global_scale); per block of 16, weight_scale = E4M3(global * (amax_block
  / 6)) (saturating at 448; a zero becomes E4M3's eps 0.125); s = weight_scale / global. E2M1 ties
  to even.
- MXFP4, rule `ocp` (OCP MX v1.0's scale, as ggml's quantize_row_mxfp4_ref / gguf.quants.MXFP4
  compute it): per block of 32, s = 2 ** (floor(log2 amax) - 2) (an all-zero block: E8M0 0); ties
  to the smaller magnitude (ggml's first-best search, where OCP says ties to even), a value
  rounding to 0 takes code 0 whatever its sign: GGUF files byte for byte the gguf package's.
- MXFP4, rule `round` (compressed-tensors' MXFP4A16, vLLM's reference_mxfp4): amax is first
  rounded to a power of two upward when its significand is >= 1.75 (round_to_power_2), then
  s = 2 ** (floor(log2 of that) - 2); E2M1 ties to even.
floor(log2 x) is taken exactly (frexp), not from a float32 log2 that can round up just below a power
of two. E8M0 exponents are clamped to [0, 254].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt import defaults
from llmopt.errors import UserInputError
from llmopt.layers.formats.fp4 import (E2M1_MAX, E4M3_MAX, E8M0_BIAS, MXFP4_BLOCK, NVFP4_BLOCK, Mxfp4Quantized,
                                       Nvfp4Quantized, e8m0_to_float, table)
from llmopt.quant.config import act_order_mode
from llmopt.quant.gptq import _inverse_cholesky_upper

_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)   # between consecutive magnitudes 0 .. 6
E4M3_EPS = 0.125              # compressed-tensors' stand-in for a zero E4M3 scale (_get_dtype_eps)
MX_RULES = ("ocp", "round")


def e2m1_codes(y: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """y = w / s (float32) -> uint8 E2M1 codes (bit 3 the sign, bits 0-2 the magnitude index).
    ties `even`: round half to even (index parity = mantissa parity), a negative y (or -0) signed;
    `down`: half toward the smaller magnitude, a zero magnitude unsigned (ggml)."""
    a = y.abs().clamp(max=E2M1_MAX)
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=a.dtype, device=a.device)
    idx = torch.bucketize(a, mids)            # a == mids[i] gives i, the smaller magnitude
    if ties == "even":
        at_mid = (idx < len(mids)) & (a == mids[idx.clamp(max=len(mids) - 1)])
        idx = idx + (at_mid & (idx % 2 == 1)).long()
        neg = torch.signbit(y)
    elif ties == "down":
        neg = (y < 0) & (idx > 0)
    else:
        raise ValueError(f"ties {ties!r}: use even or down")
    return (idx | (neg.long() << 3)).to(torch.uint8)


def _blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    out, n_in = w.shape
    if n_in % block:
        raise UserInputError(f"FP4 blocks of {block} do not divide a weight's {n_in} input features")
    return w.detach().to(torch.float32).reshape(out, n_in // block, block)


# -- NVFP4 ------------------------------------------------------------------------------------------
def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """float32 [1]: 448 * 6 / amax(w) (amax at least float32's tiny; non-finite -> 1), evaluated as
    (1 / amax) * 2688, two float32 roundings, as PyTorch evaluates llm-compressor's `448 * 6 / amax`."""
    amax = w.detach().abs().amax().to(torch.float32).clamp(min=torch.finfo(torch.float32).tiny)
    g = torch.reciprocal(amax) * (E4M3_MAX * E2M1_MAX)
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def nvfp4_block_scales(amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Per-block amax (float32) -> the E4M3 weight_scale: global * (amax / 6), saturated, 0 -> 0.125."""
    s = (global_scale.reshape(()) * (amax.to(torch.float32) / E2M1_MAX)).clamp(-E4M3_MAX, E4M3_MAX)
    s = s.to(torch.float8_e4m3fn).to(torch.float32)
    return torch.where(s == 0, E4M3_EPS, s).to(torch.float8_e4m3fn)


def quantize_nvfp4(w: torch.Tensor, bias: torch.Tensor | None = None,
                   global_scale: torch.Tensor | None = None) -> Nvfp4Quantized:
    """W [out, in] (in % 16 == 0) -> NVFP4 by round to nearest; `global_scale` shared with other
    weights (q/k/v, gate/up: llm-compressor fuses them for vLLM's fused layers), else w's own."""
    g = nvfp4_global_scale(w) if global_scale is None else global_scale.to(torch.float32).reshape(1)
    b = _blocks(w, NVFP4_BLOCK)
    ws = nvfp4_block_scales(b.abs().amax(-1), g)
    s = ws.to(torch.float32) / g
    codes = e2m1_codes(b / s[..., None], "even").reshape(w.shape)
    return Nvfp4Quantized(codes, ws, g, bias)


# -- MXFP4 ------------------------------------------------------------------------------------------
def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 x) of positive float32 values, exactly (x = m * 2**e with m in [0.5, 1))."""
    return torch.frexp(x)[1] - 1


def mxfp4_exponents(amax: torch.Tensor, rule: str) -> torch.Tensor:
    """Per-block amax (float32) -> uint8 E8M0 exponents by `rule` (module docstring)."""
    if rule not in MX_RULES:
        raise ValueError(f"MXFP4 scale rule {rule!r}: use one of {', '.join(MX_RULES)}")
    amax = amax.to(torch.float32)
    e = _floor_log2(torch.where(amax > 0, amax, 1.0))
    if rule == "round":   # round_to_power_2: a significand of 1.75 or more goes to the next power
        m = torch.frexp(amax)[0]
        e = e + (m >= 0.875).to(e.dtype)
    e = e - 2 + E8M0_BIAS
    return torch.where(amax > 0, e.clamp(0, 254), 0).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor, rule: str = "ocp", bias: torch.Tensor | None = None) -> Mxfp4Quantized:
    """W [out, in] (in % 32 == 0) -> MXFP4 by round to nearest, scales and ties by `rule`."""
    b = _blocks(w, MXFP4_BLOCK)
    e = mxfp4_exponents(b.abs().amax(-1), rule)
    codes = e2m1_codes(b / e8m0_to_float(e)[..., None], "down" if rule == "ocp" else "even")
    return Mxfp4Quantized(codes.reshape(w.shape), e, bias)


# -- GPTQ -------------------------------------------------------------------------------------------
@dataclass
class Fp4Grid:
    """How a format picks a block's scale and rounds: `nvfp4` (a global scale fixed from the whole
    weight first, as llm-compressor's GPTQ does) or `mxfp4` with its rule."""

    kind: str
    rule: str = "ocp"
    global_scale: torch.Tensor | None = None

    @property
    def block(self) -> int:
        return NVFP4_BLOCK if self.kind == "nvfp4" else MXFP4_BLOCK

    @property
    def ties(self) -> str:
        return "down" if self.kind == "mxfp4" and self.rule == "ocp" else "even"

    def stored_scales(self, amax: torch.Tensor) -> torch.Tensor:
        """Per-block amax -> the stored scale (E4M3 weight_scale or E8M0 exponents)."""
        if self.kind == "nvfp4":
            return nvfp4_block_scales(amax, self.global_scale)
        return mxfp4_exponents(amax, self.rule)

    def effective(self, stored: torch.Tensor) -> torch.Tensor:
        if self.kind == "nvfp4":
            return stored.to(torch.float32) / self.global_scale.reshape(())
        return e8m0_to_float(stored)

    def result(self, codes, stored, bias):
        if self.kind == "nvfp4":
            return Nvfp4Quantized(codes, stored, self.global_scale, bias)
        return Mxfp4Quantized(codes, stored, bias)


def gptq_fp4(w: torch.Tensor, H: torch.Tensor, grid: Fp4Grid, damp: float = defaults.GPTQ_DAMP,
             act_order: str = "none", block: int = defaults.GPTQ_BLOCK, bias: torch.Tensor | None = None):
    """GPTQ (llmopt.quant.gptq's column loop) onto an FP4 grid: each column rounded to its block's
    E2M1 grid, its error spread over the columns not yet quantized. act_order `none`: a block's
    scale from its columns as updated when the first is reached; `static`: every scale from the
    original weights up front, columns by decreasing diag(H). Runs on one thread (as gptq_quantize)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _gptq_fp4(w, H, grid, damp, act_order_mode(act_order), block, bias)
    finally:
        torch.set_num_threads(threads)


def _gptq_fp4(w, H, grid: Fp4Grid, damp, mode, block, bias):
    if mode not in ("none", "static"):
        raise UserInputError(f"--act-order {mode} with FP4 blocks: use static or none (no g_idx in these formats)")
    out_f, in_f = w.shape
    gs = grid.block
    W = _blocks(w, gs).reshape(out_f, in_f).clone()
    H = H.to(torch.float32).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    n_blocks = in_f // gs
    stored = grid.stored_scales(W.view(out_f, n_blocks, gs).abs().amax(-1))   # static's; `none` refills
    S = grid.effective(stored).t().contiguous()      # [blocks, out]: one contiguous row per block
    perm, col_block = None, torch.arange(in_f) // gs
    if mode == "static":
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H, col_block = W[:, perm], H[perm][:, perm], col_block[perm]
    Hinv = _inverse_cholesky_upper(H, damp)
    WT = W.t().contiguous()
    codes_t = torch.empty(in_f, out_f, dtype=torch.uint8)
    values = table("e2m1")
    stored_t = stored.t().clone()
    block_of = col_block.tolist()
    for b0 in range(0, in_f, block):
        b1 = min(b0 + block, in_f)
        W1 = WT[b0:b1].clone()
        Err1 = torch.empty_like(W1)
        Hinv1 = Hinv[b0:b1, b0:b1]
        d = torch.diagonal(Hinv1).clone()
        Hs = Hinv1 / d[:, None]
        for i in range(b1 - b0):
            col = b0 + i
            if mode == "none" and col % gs == 0:   # this block's scale from its columns as updated so far
                cols = torch.cat([W1[i:], WT[b1:]])[:gs]
                stored_t[col // gs] = grid.stored_scales(cols.abs().amax(0))
                S[col // gs] = grid.effective(stored_t[col // gs])
            s = S[block_of[col]]
            c = e2m1_codes(W1[i] / s, grid.ties)
            codes_t[col] = c
            e = torch.sub(W1[i], values[c.long()] * s, out=Err1[i])
            W1[i:].addr_(Hs[i, i:], e, alpha=-1)
        Err1.div_(d[:, None])
        if b1 < in_f:
            WT[b1:].addmm_(Hinv[b0:b1, b1:].t(), Err1, alpha=-1)
    codes = codes_t.t()
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    return grid.result(codes.contiguous(), stored_t.t().contiguous(), bias)


# -- what the pipeline calls -----------------------------------------------------------------------
def mx_rule(fmt: str) -> str:
    """The MXFP4 scale rule of the format written: compressed-tensors' own, else OCP's (GGUF's ggml)."""
    return "round" if fmt == "compressed-tensors" else "ocp"


def grid_for(method: str, fmt: str, w: torch.Tensor) -> Fp4Grid:
    """The grid of `method` for weight w (NVFP4: w's global scale; w may be q/k/v stacked, which
    then share it, as llm-compressor fuses them for vLLM's fused layers)."""
    if method == "nvfp4":
        return Fp4Grid("nvfp4", global_scale=nvfp4_global_scale(w))
    return Fp4Grid("mxfp4", rule=mx_rule(fmt))


def quantize_rtn(w: torch.Tensor, grid: Fp4Grid, bias: torch.Tensor | None = None):
    """Round to nearest on `grid`: quantize_nvfp4 with its global scale, or quantize_mxfp4."""
    if grid.kind == "nvfp4":
        return quantize_nvfp4(w, bias, grid.global_scale)
    return quantize_mxfp4(w, grid.rule, bias)


def rows(q, r0: int, r1: int, bias: torch.Tensor | None = None):
    """Rows r0:r1 of a stored form (a stacked q/k/v split back), with `bias`."""
    if isinstance(q, Nvfp4Quantized):
        return Nvfp4Quantized(q.codes[r0:r1].clone(), q.weight_scale[r0:r1].clone(), q.global_scale, bias)
    return Mxfp4Quantized(q.codes[r0:r1].clone(), q.exponents[r0:r1].clone(), bias)
