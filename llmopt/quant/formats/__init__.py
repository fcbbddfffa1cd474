"""Writing the checkpoint formats other tools load (llmopt.layers.formats describes and reads them):
AutoAWQ GEMM (`awq`), GPTQ v1 (`gptq`), llm-compressor's `compressed-tensors` (NVFP4 and MXFP4
included), llama.cpp's GGUF blocks (`gguf`: one file, assembled by formats/gguf.py's write_file; MXFP4
too) and transformers' `bitsandbytes` 4-bit (formats/bnb.py). Pure functions from the canonical forms
of llmopt.layers.types (FP4: llmopt.layers.formats.fp4's stored forms, bitsandbytes' BnbQuantized) to
(name -> tensor) dicts, plus the `quantization_config` entry of config.json."""

from __future__ import annotations

import torch

from llmopt.errors import UserInputError
from llmopt.layers.formats import FORMATS
from llmopt.quant.config import act_order_mode
from llmopt.quant.formats import awq, bnb, compressed_tensors, gguf, gptq

# the dtype a format stores scales in: algorithms round their scales to it before choosing codes
SCALE_DTYPE = {"awq": awq.SCALE_DTYPE, "gptq": gptq.SCALE_DTYPE, "compressed-tensors": None, "gguf": gguf.SCALE_DTYPE,
               "bitsandbytes": None}


def pack_linear(prefix: str, qt, fmt: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Full tensor names (prefix + ".qweight", ...) -> tensors for one quantized Linear.
    `dtype` sets compressed-tensors' scale/bias dtype (awq and gptq always store fp16)."""
    if fmt == "awq":
        return awq.pack(prefix, qt)
    if fmt == "gptq":
        return gptq.pack(prefix, qt)
    if fmt == "compressed-tensors":
        return compressed_tensors.pack(prefix, qt, dtype)
    if fmt == "gguf":
        return gguf.pack(prefix, qt)
    if fmt == "bitsandbytes":
        return bnb.pack(prefix, qt, dtype or torch.float16)
    raise UserInputError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")


def quantization_config(fmt: str, qconfig=None, *, method: str | None = None, bits: int | None = None,
                        group_size: int = 128, sym: bool = True, act_order: bool = False,
                        activations: str | None = None, fp8_scale: str = "channel", damp: float | None = None) -> dict:
    """The config.json `quantization_config` entry, as the peer tool writes it. Either pass a
    QuantConfig-like `qconfig` (method, bits, group_size, sym, act_order, activations, fp8_scale, damp)
    or the keywords (`activations` None: the method's default, compressed_tensors.scheme)."""
    if qconfig is not None:
        method, bits, group_size, sym = qconfig.method, qconfig.bits, qconfig.group_size, bool(qconfig.sym)
        act_order = act_order_mode(getattr(qconfig, "act_order", False)) == "group"   # static keeps g_idx trivial
        activations = getattr(qconfig, "activations", activations)
        fp8_scale = getattr(qconfig, "fp8_scale", fp8_scale)
        damp = getattr(qconfig, "damp", damp)
    if method is None:
        raise UserInputError("quantization_config needs a method (or a QuantConfig)")
    bits = bits or (8 if method in ("fp8", "int8") else 4)
    if fmt == "awq":
        return awq.quantization_config(bits, group_size)
    if fmt == "gptq":
        return gptq.quantization_config(bits, group_size, sym, act_order, damp if method == "gptq" else None)
    if fmt == "compressed-tensors":
        return compressed_tensors.quantization_config(method, bits, group_size, sym, activations, fp8_scale)
    if fmt == "gguf":   # (the work folder's; the file's metadata says it: formats/gguf.py)
        return {"quant_method": "gguf", "bits": bits, "group_size": group_size, "sym": sym}
    if fmt == "bitsandbytes":   # (compute dtype: the checkpoint's float dtype, which the pipeline sets as scale_dtype)
        compute = getattr(qconfig, "scale_dtype", None) or "bfloat16"
        return bnb.quantization_config("nf4", group_size, True, compute_dtype=compute)
    raise UserInputError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
