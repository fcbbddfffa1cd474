"""GPTQ v1 checkpoints (AutoGPTQ / GPTQModel `checkpoint_format: gptq`, vLLM `gptq`/`gptq_marlin`):
the layout and its reading (llmopt.quant.formats.gptq writes it).

Per Linear with W [out, in] and G groups:
  qweight int32 [in / 8, out]: packed along the input dim, 8 consecutive input rows per word, in order;
  qzeros  int32 [G, out / 8]:  zero points MINUS ONE (the v1 convention), packed along out;
  scales  fp16  [G, out];
  g_idx   int32 [in]:          group of each input column (act-order permutes it);
and W[o, k] = (q - z) * s with z = stored + 1. A zero point of 0 cannot be stored in v1 (it would
be -1, which the readers' unpack-and-add-one turns into 2**bits): the writer refuses it.
`checkpoint_format: gptq_v2` (GPTQModel's internal form) stores z itself; `unpack` reads both.
"""

from __future__ import annotations

import torch

from llmopt.layers.formats.packing import unpack_codes
from llmopt.layers.types import IntQuantized

SCALE_DTYPE = torch.float16


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
