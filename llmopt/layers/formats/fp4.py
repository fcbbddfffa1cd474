"""4-bit float weights: a 16-entry table of values per code set and a float scale per block of
consecutive input columns, W[n, k] = table[code[n, k]] * scale[n, k // block].

- `e2m1`: FP4 E2M1 (sign, 2 exponent bits, 1 mantissa bit; OCP MX and NVIDIA's NVFP4): code c with
  c >= 8 is -table[c - 8]. NVFP4: blocks of 16, an E4M3 scale each and a float32 global scale per
  tensor; MXFP4: blocks of 32, an E8M0 (power of two) scale each.
- `nf4`: bitsandbytes' NormalFloat4 (QLoRA), blocks of 64 by default, the block's absmax as scale.
- `bnb_fp4`: bitsandbytes' FP4 (its own E2M1 variant, exponent bias 2 with a subnormal 0.0625, scaled
  to [-1, 1] by its largest value 12), same blocks and scale as `nf4`. Code order is bit order:
  bit 3 the sign, bits 0-2 select 0, 0.0625, 8, 12, 4, 6, 2, 3 (then / 12).

NVFP4's and MXFP4's stored scale levels are Nvfp4Quantized and Mxfp4Quantized below (what
llmopt.quant.fp4 produces and the formats pack), with their layouts: compressed-tensors' nibble pairs
and GGML's MXFP4 blocks.

The runtime keeps the codes and one float32 scale per block (a format's several scale levels
multiplied out at load, exactly where the product is exact), never a float copy of the weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_E2M1_POS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1 = _E2M1_POS + tuple(-v for v in _E2M1_POS)   # code 8 is -0.0
# bitsandbytes' NF4 levels (the quantiles of N(0, 1) normalised to [-1, 1], zero exact), code order
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0)
# bitsandbytes' FP4 levels in code order (bitsandbytes.functional.get_4bit_type("fp4")): code c >= 8 is
# -table[c - 8]; v / 12 rounds to the same float32 as bitsandbytes' float32 division
_BNB_FP4_POS = tuple(v / 12 for v in (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0))
BNB_FP4 = _BNB_FP4_POS + tuple(-v for v in _BNB_FP4_POS)   # code 8 is -0.0
TABLES: dict[str, tuple[float, ...]] = {"e2m1": E2M1, "nf4": NF4, "bnb_fp4": BNB_FP4}


def table(name: str) -> torch.Tensor:
    """The 16 float32 values of a code set."""
    return torch.tensor(TABLES[name], dtype=torch.float32)


@dataclass
class Fp4Quantized:
    """The canonical form of a 4-bit float weight W [out, in] ≈ table[codes] * scales (per block).

    codes:  [out, in] uint8 in [0, 16), indices into TABLES[table_name].
    scales: [out, in // block] float32, the effective scale of each block (all scale levels applied).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    table_name: str
    block: int
    bias: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight, computed in float32 (one product a value)."""
        c = self.codes
        v = table(self.table_name).to(c.device)[c.long()]
        s = self.scales.to(torch.float32)
        w = v.view(c.shape[0], -1, self.block) * s[..., None]
        return w.view(c.shape).to(dtype)


# -- NVFP4 and MXFP4: the stored scale levels, and their layouts -----------------------------------
NVFP4_BLOCK, MXFP4_BLOCK = 16, 32
E2M1_MAX, E4M3_MAX = 6.0, 448.0
E8M0_BIAS = 127


@dataclass
class Nvfp4Quantized:
    """NVIDIA's NVFP4: W[n, k] = E2M1[codes[n, k]] * (weight_scale[n, k // 16] / global_scale), the
    quotient computed in float32 (as compressed-tensors' and vLLM's dequantization divide).

    codes:        [out, in] uint8 E2M1 codes (TABLES["e2m1"] order: bit 3 the sign).
    weight_scale: [out, in // 16] torch.float8_e4m3fn, each block's scale times global_scale.
    global_scale: [1] float32, 448 * 6 / amax of the tensor (llm-compressor's generate_gparam).
    input_global_scale: W4A4 only, [1] float32, 448 * 6 / amax of the Linear's calibration inputs.
    """

    codes: torch.Tensor
    weight_scale: torch.Tensor
    global_scale: torch.Tensor
    bias: torch.Tensor | None = None
    input_global_scale: torch.Tensor | None = None
    block = NVFP4_BLOCK

    def as_fp4(self) -> Fp4Quantized:
        scales = self.weight_scale.to(torch.float32) / self.global_scale.to(torch.float32).reshape(())
        return Fp4Quantized(self.codes, scales, "e2m1", self.block, self.bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.as_fp4().dequantize(dtype)


@dataclass
class Mxfp4Quantized:
    """OCP MXFP4: W[n, k] = E2M1[codes[n, k]] * 2 ** (exponents[n, k // 32] - 127).

    codes:     [out, in] uint8 E2M1 codes.
    exponents: [out, in // 32] uint8 E8M0 scales (biased exponents; 255, NaN in OCP, never written).
    """

    codes: torch.Tensor
    exponents: torch.Tensor
    bias: torch.Tensor | None = None
    block = MXFP4_BLOCK

    def as_fp4(self) -> Fp4Quantized:
        return Fp4Quantized(self.codes, e8m0_to_float(self.exponents), "e2m1", self.block, self.bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.as_fp4().dequantize(dtype)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 2 ** (e - 127), exact (2 ** -127 is a float32 subnormal)."""
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32), e.to(torch.int32) - E8M0_BIAS)


def pack_pairs(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [rows, cols] (cols even) -> uint8 [rows, cols / 2]: byte j holds column 2j in its
    low nibble and column 2j + 1 in its high one (compressed-tensors' pack_fp4_to_uint8)."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_pairs(packed: torch.Tensor) -> torch.Tensor:
    """pack_pairs' inverse: uint8 [rows, cols / 2] -> codes [rows, cols]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


# GGML's MXFP4 block (ggml-common.h block_mxfp4, gguf.quants.MXFP4): 32 values in 17 bytes, the E8M0
# byte e, then qs[16]: value j in the low nibble of qs[j], value 16 + j in its high nibble. ggml's
# table is E2M1 doubled (0, 1, 2, 3, 4, 6, 8, 12, then negated) with the scale halved: the same
# products, so its codes are TABLES["e2m1"]'s in the same order and e is the E8M0 exponent.
GGML_MXFP4_BYTES = 1 + MXFP4_BLOCK // 2


def mxfp4_to_ggml(q: Mxfp4Quantized) -> torch.Tensor:
    """[out, in] -> uint8 [out, in / 32 * 17], each row's GGML blocks."""
    n, k = q.codes.shape
    c = q.codes.to(torch.uint8).view(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    qs = c[..., :16] | (c[..., 16:] << 4)
    return torch.cat((q.exponents.to(torch.uint8).view(n, -1, 1), qs), dim=-1).reshape(n, -1).contiguous()


def mxfp4_from_ggml(raw: torch.Tensor, bias: torch.Tensor | None = None) -> Mxfp4Quantized:
    """uint8 [out, in / 32 * 17] GGML blocks -> Mxfp4Quantized (mxfp4_to_ggml's inverse)."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, GGML_MXFP4_BYTES)
    qs = b[..., 1:]
    codes = torch.cat((qs & 0xF, qs >> 4), dim=-1).reshape(n, -1)
    return Mxfp4Quantized(codes, b[..., 0].contiguous(), bias)
