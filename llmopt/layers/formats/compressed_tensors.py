"""compressed-tensors checkpoints, as llm-compressor writes them (read by vLLM and transformers): the
layouts and their reading (llmopt.quant.formats.compressed_tensors writes them).

Three compression formats, per Linear `prefix`:
- `pack-quantized` (W4A16, W8A16): weight_packed int32 [out, ceil(in * bits / 32)] holding the
  signed code q - 2**(bits-1) + 2**(bits-1) (= our unsigned code) 32/bits per word along `in`, in
  order; weight_scale [out, groups] (strategy group, or channel with [out, 1]); for asymmetric
  weights weight_zero_point int32 [ceil(out * bits / 32), groups] packed the same way along `out`;
  weight_shape int64 [2] = (out, in).
- `int-quantized` (W8A8): weight int8 [out, in], weight_scale [out, 1]; activations quantized
  per token, dynamically, symmetric int8.
- `float-quantized` (FP8 W8A8): weight float8_e4m3fn [out, in], weight_scale [out, 1] (channel) or
  [1] (tensor); activations per token, dynamic. Weight-only FP8 is `naive-quantized`.
"""

from __future__ import annotations

import torch

from llmopt.errors import ModelLoadError
from llmopt.layers.formats.fp4 import Mxfp4Quantized, Nvfp4Quantized, unpack_pairs
from llmopt.layers.formats.packing import unpack_codes
from llmopt.layers.types import FloatQuantized, Int8Quantized, IntQuantized

FP4_FORMATS = {"nvfp4-pack-quantized": 16, "mxfp4-pack-quantized": 32}   # format -> group size


def unpack(tensors: dict[str, torch.Tensor], group: dict):
    """Local names -> canonical form, given the module's config group (its `weights`,
    `input_activations` and `format`)."""
    w = group.get("weights") or {}
    fmt = group.get("format")
    act = "dynamic" if group.get("input_activations") else "none"
    bias = tensors.get("bias")
    if fmt in FP4_FORMATS:
        return unpack_fp4(tensors, fmt, bias)
    if fmt == "pack-quantized":
        bits, sym = int(w["num_bits"]), bool(w.get("symmetric", True))
        out, n_in = (int(v) for v in tensors["weight_shape"].tolist())
        scales = tensors["weight_scale"]
        groups = scales.shape[1]
        codes = unpack_codes(tensors["weight_packed"], bits, dim=1, count=n_in)
        if sym:
            zeros = torch.full((out, groups), 1 << (bits - 1), dtype=torch.int32)
        else:
            zeros = unpack_codes(tensors["weight_zero_point"], bits, dim=0, count=out)
        group_size = int(w["group_size"]) if w.get("strategy") == "group" else -1
        return IntQuantized(qweight=codes, scales=scales, zeros=zeros, bits=bits, group_size=group_size,
                            sym=sym, bias=bias)
    if fmt == "int-quantized":
        return Int8Quantized(weight=tensors["weight"], weight_scale=tensors["weight_scale"], activations=act,
                             bias=bias)
    if fmt in ("float-quantized", "naive-quantized") and w.get("type") == "float":
        return FloatQuantized(weight=tensors["weight"], weight_scale=tensors["weight_scale"], activations=act,
                              bias=bias)
    raise ModelLoadError(f"compressed-tensors format {fmt!r} with weights {w} is not supported: llmopt reads "
                         "pack-quantized, int-quantized, float-quantized (FP8), nvfp4- and mxfp4-pack-quantized")


def unpack_fp4(tensors: dict[str, torch.Tensor], fmt: str, bias=None):
    """An NVFP4 / MXFP4 Linear's tensors -> Nvfp4Quantized / Mxfp4Quantized (stored forms)."""
    codes = unpack_pairs(tensors["weight_packed"].to(torch.uint8))
    scale = tensors["weight_scale"]
    if codes.shape[1] != scale.shape[1] * FP4_FORMATS[fmt]:
        raise ModelLoadError(f"{fmt}: weight_packed's {codes.shape[1]} columns are not weight_scale's "
                             f"{scale.shape[1]} groups of {FP4_FORMATS[fmt]}")
    if fmt == "nvfp4-pack-quantized":
        return Nvfp4Quantized(codes, scale.to(torch.float8_e4m3fn), tensors["weight_global_scale"].float(), bias)
    return Mxfp4Quantized(codes, scale.to(torch.uint8), bias)
