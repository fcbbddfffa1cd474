"""Checkpoint formats other tools load, as the runtime reads them: AutoAWQ GEMM (`awq`), GPTQ v1
(`gptq`), llm-compressor's `compressed-tensors` and transformers' bitsandbytes 4-bit (`bitsandbytes`).
Pure functions from (name -> tensor) dicts and the `quantization_config` entry of config.json to
the canonical forms of llmopt.layers.types (bitsandbytes: llmopt.layers.formats.fp4's Fp4Quantized);
llmopt.quant.formats writes them."""

from __future__ import annotations

import torch

from llmopt.errors import ModelLoadError, UserInputError
from llmopt.layers.formats import awq, bnb, compressed_tensors, gptq

FORMATS = ("awq", "gptq", "compressed-tensors")


def format_of(qcfg: dict) -> str:
    """Which of our formats a checkpoint's quantization_config is."""
    method = str(qcfg.get("quant_method", "")).lower()
    if method == "awq":
        version = str(qcfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(f"AWQ version {version!r} is not supported: llmopt runs AutoAWQ GEMM checkpoints")
        return "awq"
    if method == "gptq":
        cf = str(qcfg.get("checkpoint_format", qcfg.get("format", "gptq"))).lower()
        if cf not in ("gptq", "gptq_v2"):
            raise ModelLoadError(f"GPTQ checkpoint_format {cf!r} is not supported: llmopt runs gptq (v1) and gptq_v2")
        return "gptq"
    if method == "compressed-tensors":
        return "compressed-tensors"
    if method == "bitsandbytes":
        bnb.config_of(qcfg)   # 4-bit nf4 / fp4 only: a one-line error for the rest
        return "bitsandbytes"
    raise ModelLoadError(f"quant_method {qcfg.get('quant_method')!r} is not supported: llmopt runs awq, gptq, "
                         "compressed-tensors and bitsandbytes (4-bit) checkpoints")


def unpack_linear(tensors: dict[str, torch.Tensor], qcfg: dict, group: dict | None = None):
    """A module's tensors (local names: qweight, scales, ...) -> canonical form. For
    compressed-tensors pass the module's config group (see runtime.ct_group_for)."""
    fmt = format_of(qcfg)
    if fmt == "awq":
        return awq.unpack(tensors, int(qcfg.get("bits", qcfg.get("w_bit", 4))),
                          int(qcfg.get("group_size", qcfg.get("q_group_size"))), sym=False)
    if fmt == "gptq":
        cf = str(qcfg.get("checkpoint_format", "gptq")).lower()
        return gptq.unpack(tensors, int(qcfg["bits"]), int(qcfg["group_size"]), bool(qcfg.get("sym", True)), cf)
    if fmt == "bitsandbytes":   # (local names: weight, weight.absmax, ..., weight.quant_state.bitsandbytes__nf4)
        return bnb.unpack(tensors).as_fp4()
    if group is None:
        raise UserInputError("unpacking compressed-tensors needs the module's config group")
    return compressed_tensors.unpack(tensors, group)
