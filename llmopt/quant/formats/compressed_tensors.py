"""compressed-tensors checkpoints, as llm-compressor writes them (read by vLLM and transformers).

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

from llmopt.errors import ModelLoadError, UserInputError
from llmopt.quant.formats.packing import has_trivial_groups, pack_codes, unpack_codes
from llmopt.quant.types import FloatQuantized, Int8Quantized, IntQuantized

CT_VERSION = "0.20.1"   # the compressed-tensors release whose config layout this writes


def _as_packable(qt):
    """Weight-only INT8 is written as 8-bit pack-quantized (llm-compressor's W8A16)."""
    if isinstance(qt, Int8Quantized) and qt.activations == "none":
        out, n_in = qt.weight.shape
        return IntQuantized(qweight=qt.weight.to(torch.int32) + 128, scales=qt.weight_scale.reshape(out, 1),
                            zeros=torch.full((out, 1), 128, dtype=torch.int32), bits=8, group_size=-1, sym=True,
                            bias=qt.bias)
    return qt


def pack(prefix: str, qt, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`dtype`: the checkpoint's float dtype for scales and bias (default: keep the scales' dtype)."""
    qt = _as_packable(qt)
    out: dict[str, torch.Tensor] = {}
    if isinstance(qt, IntQuantized):
        if not has_trivial_groups(qt.g_idx, qt.in_features, qt.group_size):
            raise UserInputError(f"{prefix}: compressed-tensors has no g_idx: act-order weights need --format gptq")
        half = 1 << (qt.bits - 1)
        if qt.sym and bool((qt.zeros != half).any()):
            raise UserInputError(f"{prefix}: symmetric weights must have every zero point at {half}")
        out[f"{prefix}.weight_packed"] = pack_codes(qt.qweight, qt.bits, dim=1, pad=True)
        out[f"{prefix}.weight_scale"] = qt.scales.to(dtype or qt.scales.dtype).contiguous()
        if not qt.sym:
            out[f"{prefix}.weight_zero_point"] = pack_codes(qt.zeros, qt.bits, dim=0, pad=True)
        out[f"{prefix}.weight_shape"] = torch.tensor([qt.out_features, qt.in_features], dtype=torch.int64)
    elif isinstance(qt, (FloatQuantized, Int8Quantized)):
        want = torch.float8_e4m3fn if isinstance(qt, FloatQuantized) else torch.int8
        if qt.weight.dtype != want:
            raise UserInputError(f"{prefix}: expected a {want} weight, got {qt.weight.dtype}")
        out[f"{prefix}.weight"] = qt.weight.contiguous()
        out[f"{prefix}.weight_scale"] = qt.weight_scale.to(dtype or qt.weight_scale.dtype).contiguous()
    else:
        raise UserInputError(f"{prefix}: compressed-tensors cannot hold {type(qt).__name__}")
    if qt.bias is not None:
        out[f"{prefix}.bias"] = qt.bias.to(dtype or qt.bias.dtype)
    return out


def unpack(tensors: dict[str, torch.Tensor], group: dict):
    """Local names -> canonical form, given the module's config group (its `weights`,
    `input_activations` and `format`)."""
    w = group.get("weights") or {}
    fmt = group.get("format")
    act = "dynamic" if group.get("input_activations") else "none"
    bias = tensors.get("bias")
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
                         "pack-quantized, int-quantized and float-quantized (FP8)")


def _args(num_bits: int, type_: str, strategy: str, group_size: int | None, symmetric: bool,
          dynamic: bool = False) -> dict:
    return {"dynamic": dynamic, "group_size": group_size, "num_bits": num_bits, "strategy": strategy,
            "symmetric": symmetric, "type": type_}


def scheme(method: str, bits: int = 4, group_size: int = 128, sym: bool = True, activations: str = "dynamic",
           fp8_scale: str = "channel") -> tuple[str, dict, dict | None]:
    """(format, weights args, input_activations args) for one of our methods."""
    dyn_token = lambda type_: _args(8, type_, "token", None, True, dynamic=True)  # noqa: E731
    if method == "fp8":
        weights = _args(8, "float", fp8_scale, None, True)
        if activations == "dynamic":
            return "float-quantized", weights, dyn_token("float")
        return "naive-quantized", weights, None
    if method == "int8":
        if activations == "dynamic":
            return "int-quantized", _args(8, "int", "channel", None, True), dyn_token("int")
        return "pack-quantized", _args(8, "int", "channel", None, True), None
    strategy = "channel" if group_size == -1 else "group"
    return "pack-quantized", _args(bits, "int", strategy, None if group_size == -1 else group_size, sym), None


def quantization_config(method: str, bits: int = 4, group_size: int = 128, sym: bool = True,
                        activations: str = "dynamic", fp8_scale: str = "channel",
                        ignore: list[str] | None = None) -> dict:
    """The config.json entry llm-compressor writes (ModelCompressor.update_config)."""
    fmt, weights, inputs = scheme(method, bits, group_size, sym, activations, fp8_scale)
    group = {"format": fmt, "input_activations": inputs, "output_activations": None, "targets": ["Linear"],
             "weights": weights}
    return {"config_groups": {"group_0": group}, "format": fmt, "global_compression_ratio": None,
            "ignore": list(ignore) if ignore is not None else ["lm_head"], "kv_cache_scheme": None,
            "moe_sparsity_config": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": CT_VERSION}
