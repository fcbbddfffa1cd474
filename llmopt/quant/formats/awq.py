"""AutoAWQ GEMM checkpoints (read by AutoAWQ, vLLM `awq`/`awq_marlin`, transformers via gptqmodel).

Per Linear with W [out, in] and groups along `in`:
  qweight int32 [in, out / 8]: row k holds the codes of column k of W; each word packs 8 output
                               channels in the nibble order (0, 2, 4, 6, 1, 3, 5, 7);
  qzeros  int32 [in / group, out / 8]: zero points, same packing;
  scales  fp16  [in / group, out];
and W[o, k] = (q - z) * s. AutoAWQ always stores zero points (`zero_point: true`); a symmetric
quantization is written with every zero equal to 2**(bits-1).
"""

from __future__ import annotations

import torch

from llmopt.errors import UserInputError
from llmopt.quant.formats.packing import AWQ_ORDER, codes_per_word, has_trivial_groups, pack_codes, unpack_codes
from llmopt.quant.types import IntQuantized

SCALE_DTYPE = torch.float16


def _order(bits: int):
    return AWQ_ORDER if bits == 4 else None


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
        f"{prefix}.qweight": pack_codes(qt.qweight.t(), qt.bits, dim=1, order=_order(qt.bits)),
        f"{prefix}.qzeros": pack_codes(qt.zeros.t(), qt.bits, dim=1, order=_order(qt.bits)),
        f"{prefix}.scales": qt.scales.t().to(SCALE_DTYPE).contiguous(),
    }
    if qt.bias is not None:
        out[f"{prefix}.bias"] = qt.bias.to(SCALE_DTYPE)
    return out


def unpack(tensors: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool = False) -> IntQuantized:
    """Local names (qweight, qzeros, scales[, bias]) -> the canonical form."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    out = scales.shape[1]
    codes = unpack_codes(qweight, bits, dim=1, order=_order(bits), count=out).t().contiguous()
    zeros = unpack_codes(qzeros, bits, dim=1, order=_order(bits), count=out).t().contiguous()
    return IntQuantized(qweight=codes, scales=scales.t().contiguous(), zeros=zeros, bits=bits,
                        group_size=group_size, sym=sym, bias=tensors.get("bias"))


def quantization_config(bits: int, group_size: int, modules_to_not_convert: list[str] | None = None) -> dict:
    """The config.json entry AutoAWQ writes (AwqConfig.to_transformers_dict)."""
    return {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": bits,
            "version": "gemm", "modules_to_not_convert": modules_to_not_convert}
