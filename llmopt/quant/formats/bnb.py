"""Writing bitsandbytes 4-bit checkpoints as transformers saves a `load_in_4bit` model: each Linear4bit's
tensors (llmopt.layers.formats.bnb describes and reads them) and the config.json entry."""

from __future__ import annotations

import json

import torch

from llmopt.errors import UserInputError
from llmopt.layers.formats.bnb import BLOCKSIZES, QUANT_TYPES, BnbQuantized

_COMPUTE_DTYPES = ("float32", "float16", "bfloat16")


def pack(prefix: str, q: BnbQuantized, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Full tensor names -> tensors of one Linear4bit. `dtype`: the checkpoint's float dtype (the
    bias's, and the quant_state's `dtype`: what bitsandbytes dequantizes to)."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise UserInputError(f"{prefix}: bitsandbytes dequantizes to float16, bfloat16 or float32, not {dtype}")
    w = f"{prefix}.weight"
    out = {w: q.weight.to(torch.uint8).reshape(-1, 1).contiguous(),
           f"{w}.absmax": q.absmax.contiguous(),
           f"{w}.quant_map": q.quant_map.to(torch.float32).contiguous()}
    if q.double_quant:
        out[f"{w}.nested_absmax"] = q.nested_absmax.to(torch.float32).contiguous()
        out[f"{w}.nested_quant_map"] = q.nested_quant_map.to(torch.float32).contiguous()
    state = dict(q.state(), dtype=str(dtype).removeprefix("torch."))
    out[f"{w}.quant_state.bitsandbytes__{q.quant_type}"] = torch.tensor(list(json.dumps(state).encode("utf-8")),
                                                                         dtype=torch.uint8)
    if q.bias is not None:
        out[f"{prefix}.bias"] = q.bias.to(dtype).contiguous()
    return out


def quantization_config(quant_type: str = "nf4", block: int = 64, double_quant: bool = True,
                        compute_dtype: str = "bfloat16") -> dict:
    """config.json's quantization_config as transformers' BitsAndBytesConfig.to_dict writes it. The
    block size is not a field of it: each Linear's quant_state carries it (transformers' own
    quantization always uses 64; any of bitsandbytes' sizes loads)."""
    if quant_type not in QUANT_TYPES:
        raise UserInputError(f"unknown bitsandbytes quant_type {quant_type!r}: use nf4 or fp4")
    if block not in BLOCKSIZES:
        raise UserInputError(f"bitsandbytes block size {block} is not one of {', '.join(map(str, BLOCKSIZES))}")
    compute_dtype = compute_dtype.removeprefix("torch.")
    if compute_dtype not in _COMPUTE_DTYPES:
        raise UserInputError(f"bnb_4bit_compute_dtype {compute_dtype!r}: use one of {', '.join(_COMPUTE_DTYPES)}")
    return {"_load_in_4bit": True, "_load_in_8bit": False, "bnb_4bit_compute_dtype": compute_dtype,
            "bnb_4bit_quant_storage": "uint8", "bnb_4bit_quant_type": quant_type,
            "bnb_4bit_use_double_quant": bool(double_quant), "llm_int8_enable_fp32_cpu_offload": False,
            "llm_int8_has_fp16_weight": False, "llm_int8_skip_modules": None, "llm_int8_threshold": 6.0,
            "load_in_4bit": True, "load_in_8bit": False, "quant_method": "bitsandbytes"}
