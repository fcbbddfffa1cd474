"""GPTQ v1 checkpoints (AutoGPTQ / GPTQModel `checkpoint_format: gptq`, vLLM `gptq`/`gptq_marlin`).

Per Linear with W [out, in] and G groups:
  qweight int32 [in / 8, out]: packed along the input dim, 8 consecutive input rows per word, in order;
  qzeros  int32 [G, out / 8]:  zero points MINUS ONE (the v1 convention), packed along out;
  scales  fp16  [G, out];
  g_idx   int32 [in]:          group of each input column (act-order permutes it);
and W[o, k] = (q - z) * s with z = stored + 1. A zero point of 0 cannot be stored in v1 (it would
be -1, which the readers' unpack-and-add-one turns into 2**bits): `pack` refuses it.
`checkpoint_format: gptq_v2` (GPTQModel's internal form) stores z itself; `unpack` reads both.
"""

from __future__ import annotations

import torch

from llmopt.errors import UserInputError
from llmopt.quant.formats.packing import codes_per_word, pack_codes, unpack_codes
from llmopt.quant.types import IntQuantized

SCALE_DTYPE = torch.float16


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


def unpack(tensors: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool,
           checkpoint_format: str = "gptq") -> IntQuantized:
    """Local names (qweight, qzeros, scales, g_idx[, bias]) -> the canonical form."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    out = scales.shape[1]
    codes = unpack_codes(qweight, bits, dim=0).t().contiguous()
    zeros = unpack_codes(qzeros, bits, dim=1, count=out).t().contiguous()
    if checkpoint_format != "gptq_v2":
        zeros = zeros + 1
    in_features = codes.shape[1]
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        g_idx = g_idx.to(torch.int32)
        gs = in_features if group_size == -1 else group_size
        if scales.shape[0] == -(-in_features // gs) and \
                torch.equal(g_idx.cpu(), torch.arange(in_features, dtype=torch.int32) // gs):
            g_idx = None
    return IntQuantized(qweight=codes, scales=scales.t().contiguous(), zeros=zeros.to(torch.int32), bits=bits,
                        group_size=group_size, sym=sym, g_idx=g_idx, bias=tensors.get("bias"))


def quantization_config(bits: int, group_size: int, sym: bool, act_order: bool, damp: float | None = None,
                        true_sequential: bool = True) -> dict:
    """The config.json entry, with the keys GPTQModel and AutoGPTQ write for a v1 checkpoint."""
    from llmopt import __version__
    cfg = {"bits": bits, "group_size": group_size, "desc_act": act_order, "sym": sym, "lm_head": False,
           "quant_method": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32",
           "true_sequential": true_sequential, "static_groups": False,
           "meta": {"quantizer": [f"llmopt:{__version__}"]}}
    if damp is not None:
        cfg["damp_percent"] = damp
    return cfg
