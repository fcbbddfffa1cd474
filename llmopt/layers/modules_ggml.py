"""Runtime modules for GGUF tensors run as stored (llmopt.models.gguf_weights builds them).

GGMLLinear: a GGML block-format weight (llmopt.layers.formats.ggml) in the CPU kernels' grouped
layouts, decoded straight into them at load: where the width is a multiple of 64, 4-bit codes as
the int4 tiles' nibbles (uint8 [out, in / 2]), 5- and 6-bit ones as those nibbles and their high
bits (uint8 [out, in * bits / 8]); other widths as a byte a code. A scale per group of
32 (16 for Q6_K) and a scaled zero as the file stores them, widened by the kernels where read: the
fp16 d and m of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, a K-quant's 6- or 8-bit sub-scales with its fp16 d and
dmin per 256. Q4_0's, Q5_0's and Q6_K's zero is implied by the scale (8, 16, 32 x d): one zero
code for the layer (the int8-activation kernels take it off 5- and 6-bit codes as they decode
them). So Q4_0, Q4_1, Q5_0, Q5_1 and Q6_K matrices hold the file's bytes, Q4_K and Q5_K ones an
eighth of a bit a weight more (sub-scales a byte each, not 6 bits). It is a PackedIntLinear, so the
fused q/k/v and gate/up, the C++ decode layers and the int8-activation tiles take it as they take
AWQ and GPTQ layers.

On CUDA the same codes are repacked once for the Triton dequantize-GEMM (llmopt.kernels.w4a16):
int32 words of 4-bit codes (Q4_0, Q4_1, Q4_K) or 8-bit ones (Q5_x, Q5_K, Q6_K; Q8_0 shifted by
128) along the input, float32 scales and zero points [groups, out] with W = (code - zero) * scale,
the zero point szero / scale (kernel_layout).

GGMLEmbedding: the token table in the same form, rows gathered in their codes and decoded; a tied
head and embedding share one table.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from llmopt.errors import ModelLoadError
from llmopt.ggml_types import HALF_SCALE_TYPES
from llmopt.kernels import cpu_quant
from llmopt.layers.formats.ggml import GroupedCodes
from llmopt.layers.formats.packing import pack_codes, unpack_codes
from llmopt.layers.modules import PackedIntLinear


def kernel_layout(g: GroupedCodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(qweight int32 [in / per, out], scales [G, out], zeros [G, out], bits): the Triton kernel's
    layout of `g`, W = (code - zero) * scale within float32 rounding of codes * scale - szero. A
    group whose scale is 0 (a constant group: Q4_1's d = 0) becomes codes 1, zero 0, scale -szero."""
    n, k = g.shape
    bits = 4 if g.bits <= 4 else 8
    codes = g.unpacked().to(torch.int32).view(n, k // g.group_size, g.group_size)
    scales, szeros = g.float_scales().clone(), g.float_szeros()   # (Q4_0's implied zero: 8 d)
    if szeros is not None:
        flat = scales == 0
        zeros = torch.where(flat, torch.zeros_like(scales), szeros / torch.where(flat, 1.0, scales))
        codes = torch.where(flat[..., None], torch.ones_like(codes), codes)
        scales = torch.where(flat, -szeros, scales)
    else:   # signed codes (Q8_0), shifted into [0, 256)
        codes, zeros = codes + 128, torch.full_like(scales, 128.0)
    qweight = pack_codes(codes.view(n, k).t(), bits, dim=0)
    return qweight, scales.t().contiguous(), zeros.t().contiguous(), bits


class GGMLLinear(PackedIntLinear):
    """A Linear whose weight is a GGUF tensor of one of formats/ggml.py's types: the CPU kernels'
    layout, or with `triton` the Triton kernel's (kernel_layout), placed on `device`."""

    def __init__(self, g: GroupedCodes, ggml_type: str, triton: bool = False, device: torch.device | None = None) -> None:
        out_features, in_features = g.shape
        if triton:
            qweight, scales, zeros, bits = (t.to(device) if torch.is_tensor(t) else t for t in kernel_layout(g))
            super().__init__(in_features, out_features, False, bits=bits, group_size=g.group_size, sym=False)
            self.ggml_type = ggml_type
            self._kernel = (qweight, scales, zeros, None, g.group_size)
            return
        kind, codes = g.kind, g.kernel_codes()
        super().__init__(in_features, out_features, False, bits=4 if kind == "w4" else 8,   # (int32 words' bits:
                         group_size=g.group_size, sym=False)                               # CUDA's, unused here)
        self.ggml_type = ggml_type
        # the file's d and m as fp16, a K-quant's sub-scales and d as stored, a zero code as fp16 (all exact)
        held = torch.float16 if ggml_type in HALF_SCALE_TYPES else None
        szeros = g.szeros.half() if cpu_quant.is_zero_code(g.szeros) else g.szeros.to(held or g.szeros.dtype)
        self.register_buffer("cpu_codes", codes, persistent=False)
        self.register_buffer("cpu_scales", g.scales.to(held or g.scales.dtype).contiguous(), persistent=False)
        self.register_buffer("cpu_szeros", szeros.contiguous(), persistent=False)
        self.register_buffer("cpu_perm", None, persistent=False)
        self._cpu = (kind, g.group_size)

    def kernel_rows(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 weight rows [len(rows) or out, in] decoded from the kernel's layout."""
        qweight, scales, zeros, _, gs = self._kernel
        if rows is not None:
            qweight, scales, zeros = qweight[:, rows], scales[:, rows], zeros[:, rows]
        codes = unpack_codes(qweight, self.bits, dim=0)            # [in, rows]
        g = torch.arange(codes.shape[0], device=codes.device) // gs
        return ((codes.float() - zeros[g]) * scales[g]).t()

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.kernel_rows().to(dtype) if self._kernel is not None else super().dequantized(dtype)

    def finish_loading(self) -> None:   # built ready to run: nothing was loaded into it
        pass

    def canonical(self):
        raise ModelLoadError(f"a {self.ggml_type} GGUF layer runs on the CPU kernels only")

    def extra_repr(self) -> str:
        return super().extra_repr() + f", ggml_type={self.ggml_type}"


class GGMLEmbedding(nn.Module):
    """Token rows decoded from a GGMLLinear's table (the tied head's, or the embedding's own)."""

    def __init__(self, table: GGMLLinear, dtype: torch.dtype, owner: bool) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.dtype = dtype
        self.ggml_type = table.ggml_type
        if owner:    # untied: the table is this module's (its buffers counted once, here)
            self.own = table
        self.table = [table]   # not a submodule when tied: the head owns it

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table[0]
        if t._kernel is not None:   # CUDA: the rows' columns of the kernel's words
            return t.kernel_rows(ids.reshape(-1)).view(*ids.shape, self.embedding_dim).to(self.dtype)
        kind, gs = t._cpu
        flat = ids.reshape(-1)
        codes = cpu_quant.unpack(kind, t.cpu_codes[flat])
        szeros = t.cpu_szeros[flat] if t.cpu_szeros.dim() == 2 else t.cpu_szeros
        w = cpu_quant.grouped_weight(codes, t.cpu_scales[flat], szeros, gs)
        return w.view(*ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, ggml_type={self.ggml_type}"
