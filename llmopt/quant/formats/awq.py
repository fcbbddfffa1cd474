"""Writing AutoAWQ GEMM checkpoints: the layout is llmopt.layers.formats.awq's (which reads it)."""

from __future__ import annotations

import torch

from llmopt.errors import UserInputError
from llmopt.layers.formats.awq import SCALE_DTYPE, order
from llmopt.layers.formats.packing import codes_per_word, has_trivial_groups, pack_codes
from llmopt.layers.types import IntQuantized


def pack(prefix: str, qt: IntQuantized) -> dict[str, torch.Tensor]:
    if not isinstance(qt, IntQuantized):
        raise UserInputError(f"{prefix}: the awq format holds integer group quantization, not {type(qt).__name__}")
    per = codes_per_word(qt.bits)
    if qt.group_size == -1:
        raise UserInputError(f"{prefix}: the awq format needs a group size (AutoAWQ GEMM has no per-channel mode)")
    if qt.out_features % per or qt.in_features % qt.group_size:
        raise UserInputError(f"{prefix}: [{qt.out_features}, {qt.in_features}] does not fit awq packing "
                             f"(out a multiple of {per}, in a multiple of the group size {qt.group_size})")
    if not has_trivial_groups(qt.g_idx, qt.in_features, qt.group_size):
        raise UserInputError(f"{prefix}: the awq format has no g_idx: act-order weights need --format gptq")
    out = {
        f"{prefix}.qweight": pack_codes(qt.qweight.t(), qt.bits, dim=1, order=order(qt.bits)),
        f"{prefix}.qzeros": pack_codes(qt.zeros.t(), qt.bits, dim=1, order=order(qt.bits)),
        f"{prefix}.scales": qt.scales.t().to(SCALE_DTYPE).contiguous(),
    }
    if qt.bias is not None:
        out[f"{prefix}.bias"] = qt.bias.to(SCALE_DTYPE)
    return out


def quantization_config(bits: int, group_size: int, modules_to_not_convert: list[str] | None = None) -> dict:
    """The config.json entry AutoAWQ writes (AwqConfig.to_transformers_dict)."""
    return {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": bits,
            "version": "gemm", "modules_to_not_convert": modules_to_not_convert}
