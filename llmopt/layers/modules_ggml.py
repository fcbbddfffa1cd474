"""Runtime modules for GGUF tensors run as stored (llmopt.models.gguf_weights builds them).

GGMLLinear: a GGML block-format weight (llmopt.layers.formats.ggml) repacked once into the CPU
kernels' grouped layout: 4-bit codes as the int4 tiles' nibbles (uint8 [out, in / 2]) where the
width is a multiple of 64, other widths as int8 codes [out, in]; float32 scales and scale * zero
per group of 32 (16 for Q6_K). It is a PackedIntLinear, so the fused q/k/v and gate/up, the C++
decode layers and the int8-activation tiles take it as they take AWQ and GPTQ layers.

GGMLEmbedding: the token table in the same form, rows gathered in their codes and decoded; a tied
head and embedding share one table.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from llmopt.errors import ModelLoadError
from llmopt.kernels import cpu_quant
from llmopt.layers.formats.ggml import GroupedCodes
from llmopt.layers.modules import PackedIntLinear


def _store(g: GroupedCodes) -> tuple[str, torch.Tensor]:
    n, k = g.codes.shape
    if g.bits == 4 and k % 64 == 0:
        return "w4", cpu_quant.pack_int4(g.codes)
    return "w8", g.codes.to(torch.int8).contiguous()


class GGMLLinear(PackedIntLinear):
    """A Linear whose weight is a GGUF tensor of one of formats/ggml.py's types (CPU only)."""

    def __init__(self, g: GroupedCodes, ggml_type: str) -> None:
        out_features, in_features = g.codes.shape
        kind, codes = _store(g)
        super().__init__(in_features, out_features, False, bits=4 if kind == "w4" else 8,
                         group_size=g.group_size, sym=False)
        self.ggml_type = ggml_type
        self.register_buffer("cpu_codes", codes, persistent=False)
        self.register_buffer("cpu_scales", g.scales.contiguous(), persistent=False)
        self.register_buffer("cpu_szeros", g.szeros.contiguous(), persistent=False)
        self.register_buffer("cpu_perm", None, persistent=False)
        self._cpu = (kind, g.group_size)

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
        kind, gs = t._cpu
        flat = ids.reshape(-1)
        codes = t.cpu_codes[flat]
        if kind == "w4":
            codes = cpu_quant.unpack_int4(codes)
        w = codes.float().view(flat.numel(), -1, gs) * t.cpu_scales[flat][..., None]
        if t.cpu_szeros.numel():
            w = w - t.cpu_szeros[flat][..., None]
        return w.view(*ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, ggml_type={self.ggml_type}"
