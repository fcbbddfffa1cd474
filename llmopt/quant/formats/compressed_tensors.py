"""Writing compressed-tensors checkpoints, as llm-compressor writes them: the tensors of each
compression format (llmopt.layers.formats.compressed_tensors describes and reads them) and the
config.json entry."""

from __future__ import annotations

import torch

from llmopt.errors import UserInputError
from llmopt.layers.formats.fp4 import Mxfp4Quantized, Nvfp4Quantized, pack_pairs
from llmopt.layers.formats.packing import has_trivial_groups, pack_codes
from llmopt.layers.types import FloatQuantized, Int8Quantized, IntQuantized

CT_VERSION = "0.20.1"   # the compressed-tensors release whose config layout this writes
# method -> (format, weights strategy, group size, scale_dtype) of compressed-tensors' NVFP4A16 / MXFP4A16
FP4_SCHEMES = {"nvfp4": ("nvfp4-pack-quantized", "tensor_group", 16, "torch.float8_e4m3fn"),
               "mxfp4": ("mxfp4-pack-quantized", "group", 32, "torch.uint8")}
# method -> (dynamic, extra fields) of the input_activations of their W4A4 presets NVFP4 / MXFP4 (the rest as the
# weights'): NVFP4's per-16 scales at run time under a static global scale ("local") calibrated by min/max
FP4_INPUTS = {"nvfp4": ("local", {"observer": "static_minmax"}), "mxfp4": (True, {})}


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
    elif isinstance(qt, (Nvfp4Quantized, Mxfp4Quantized)):
        out.update(_pack_fp4(prefix, qt))
    else:
        raise UserInputError(f"{prefix}: compressed-tensors cannot hold {type(qt).__name__}")
    if qt.bias is not None:
        out[f"{prefix}.bias"] = qt.bias.to(dtype or qt.bias.dtype)
    return out


def _pack_fp4(prefix: str, qt) -> dict[str, torch.Tensor]:
    """nvfp4-pack-quantized: weight_packed uint8 [out, in / 2] (pack_pairs), weight_scale
    float8_e4m3fn [out, in / 16], weight_global_scale float32 [1] (W4A4: input_global_scale float32
    [1] too); mxfp4-pack-quantized: the same weight_packed and weight_scale uint8 [out, in / 32] E8M0
    exponents."""
    out = {f"{prefix}.weight_packed": pack_pairs(qt.codes)}
    if isinstance(qt, Nvfp4Quantized):
        out[f"{prefix}.weight_scale"] = qt.weight_scale.to(torch.float8_e4m3fn).contiguous()
        out[f"{prefix}.weight_global_scale"] = qt.global_scale.to(torch.float32).reshape(1).clone()   # (q/k/v share it)
        if qt.input_global_scale is not None:
            out[f"{prefix}.input_global_scale"] = qt.input_global_scale.to(torch.float32).reshape(1).clone()
    else:
        out[f"{prefix}.weight_scale"] = qt.exponents.to(torch.uint8).contiguous()
    return out


def _args(num_bits: int, type_: str, strategy: str, group_size: int | None, symmetric: bool,
          dynamic: bool = False) -> dict:
    return {"dynamic": dynamic, "group_size": group_size, "num_bits": num_bits, "strategy": strategy,
            "symmetric": symmetric, "type": type_}


def scheme(method: str, bits: int = 4, group_size: int = 128, sym: bool = True, activations: str | None = None,
           fp8_scale: str = "channel") -> tuple[str, dict, dict | None]:
    """(format, weights args, input_activations args) for one of our methods; `activations` None: the
    method's default (dynamic for fp8 / int8, none for nvfp4 / mxfp4)."""
    if activations is None:
        activations = "none" if method in FP4_SCHEMES else "dynamic"
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
    if method in FP4_SCHEMES:   # NVFP4A16, MXFP4A16, or W4A4 NVFP4, MXFP4; the scale dtype tells the loaders the scales' type
        fmt, strategy, block, scale_dtype = FP4_SCHEMES[method]
        weights = dict(_args(4, "float", strategy, block, True), scale_dtype=scale_dtype)
        if activations != "dynamic":
            return fmt, weights, None
        dynamic, extra = FP4_INPUTS[method]
        return fmt, weights, dict(weights, dynamic=dynamic, **extra)
    strategy = "channel" if group_size == -1 else "group"
    return "pack-quantized", _args(bits, "int", strategy, None if group_size == -1 else group_size, sym), None


def quantization_config(method: str, bits: int = 4, group_size: int = 128, sym: bool = True,
                        activations: str | None = None, fp8_scale: str = "channel",
                        ignore: list[str] | None = None) -> dict:
    """The config.json entry llm-compressor writes (ModelCompressor.update_config)."""
    fmt, weights, inputs = scheme(method, bits, group_size, sym, activations, fp8_scale)
    group = {"format": fmt, "input_activations": inputs, "output_activations": None, "targets": ["Linear"],
             "weights": weights}
    return {"config_groups": {"group_0": group}, "format": fmt, "global_compression_ratio": None,
            "ignore": list(ignore) if ignore is not None else ["lm_head"], "kv_cache_scheme": None,
            "moe_sparsity_config": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": CT_VERSION}
