"""Checkpoint formats other tools load, as the runtime reads them: AutoAWQ GEMM (`awq`), GPTQ v1
(`gptq`) and llm-compressor's `compressed-tensors`. Pure functions from (name -> tensor) dicts and
the `quantization_config` entry of config.json to the canonical forms of llmopt.layers.types;
llmopt.quant.formats writes them."""

from __future__ import annotations

import torch

from llmopt.errors import ModelLoadError, UserInputError
from llmopt.layers.formats import awq, compressed_tensors, gptq

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
    raise ModelLoadError(f"quant_method {qcfg.get('quant_method')!r} is not supported: llmopt runs awq, gptq "
                         "and compressed-tensors checkpoints")


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
    if group is None:
        raise UserInputError("unpacking compressed-tensors needs the module's config group")
    return compressed_tensors.unpack(tensors, group)
