"""Writing GPTQ v1 checkpoints: the layout is llmopt.layers.formats.gptq's (which reads v1 and v2)."""

from __future__ import annotations

import torch

from llmopt import __version__
from llmopt.errors import UserInputError
from llmopt.layers.formats.gptq import SCALE_DTYPE
from llmopt.layers.formats.packing import codes_per_word, pack_codes
from llmopt.layers.types import IntQuantized


def pack(prefix: str, qt: IntQuantized) -> dict[str, torch.Tensor]:
    if not isinstance(qt, IntQuantized):
        raise UserInputError(f"{prefix}: the gptq format holds integer group quantization, not {type(qt).__name__}")
    per = codes_per_word(qt.bits)
    if qt.out_features % per or qt.in_features % per:
        raise UserInputError(f"{prefix}: [{qt.out_features}, {qt.in_features}] does not fit gptq packing "
                             f"(both dims multiples of {per})")
    if bool((qt.zeros == 0).any()):
        raise UserInputError(f"{prefix}: a zero point of 0 cannot be written in GPTQ v1 (stored minus one): "
                             "quantize with zero points >= 1, --sym, or --format compressed-tensors")
    out = {
        f"{prefix}.qweight": pack_codes(qt.qweight.t(), qt.bits, dim=0),
        f"{prefix}.qzeros": pack_codes(qt.zeros.t() - 1, qt.bits, dim=1),
        f"{prefix}.scales": qt.scales.t().to(SCALE_DTYPE).contiguous(),
        f"{prefix}.g_idx": qt.group_index().to(torch.int32).contiguous(),
    }
    if qt.bias is not None:
        out[f"{prefix}.bias"] = qt.bias.to(SCALE_DTYPE)
    return out


def quantization_config(bits: int, group_size: int, sym: bool, act_order: bool, damp: float | None = None,
                        true_sequential: bool = True) -> dict:
    """The config.json entry, with the keys GPTQModel and AutoGPTQ write for a v1 checkpoint."""
    cfg = {"bits": bits, "group_size": group_size, "desc_act": act_order, "sym": sym, "lm_head": False,
           "quant_method": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32",
           "true_sequential": true_sequential, "static_groups": False,
           "meta": {"quantizer": [f"llmopt:{__version__}"]}}
    if damp is not None:
        cfg["damp_percent"] = damp
    return cfg
