"""AutoAWQ GEMM checkpoints (read by AutoAWQ, vLLM `awq`/`awq_marlin`, transformers via gptqmodel):
the layout and its reading (llmopt.quant.formats.awq writes it).

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

from llmopt.layers.formats.packing import AWQ_ORDER, unpack_codes
from llmopt.layers.types import IntQuantized

SCALE_DTYPE = torch.float16


def order(bits: int):
    """The nibble order of `bits`-bit codes in a word (None: in order)."""
    return AWQ_ORDER if bits == 4 else None


def unpack(tensors: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool = False) -> IntQuantized:
    """Local names (qweight, qzeros, scales[, bias]) -> the canonical form."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    out = scales.shape[1]
    codes = unpack_codes(qweight, bits, dim=1, order=order(bits), count=out).t().contiguous()
    zeros = unpack_codes(qzeros, bits, dim=1, order=order(bits), count=out).t().contiguous()
    return IntQuantized(qweight=codes, scales=scales.t().contiguous(), zeros=zeros, bits=bits,
                        group_size=group_size, sym=sym, bias=tensors.get("bias"))
