"""Runtime modules for 8-bit compressed-tensors checkpoints: FP8 e4m3 (float-quantized, or
naive-quantized when weight-only) and INT8 W8A8 (int-quantized).

W8A8 quantizes the activations per token, dynamically and symmetrically, as vLLM does
(`layers/activations.py`, the definition calibration simulates too), then y = (xq @ w8ᵀ) * s * s_w.
On CUDA through torch._scaled_mm (fp8, row-wise scales) and torch._int_mm (int8), on the CPU the
same arithmetic in float32 through llmopt.kernels.cpu_quant (the 8-bit weight decoded inside the
GEMV/GEMM: no float copy is kept). Weight-only 8-bit dequantizes per call on a GPU.

Int8Head / Int8Embedding: the LM head (and a tied embedding table) in int8 per row, for quantized
models on the CPU (`quantize_lm_head`; --lm-head-dtype).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmopt.kernels import cpu_quant
from llmopt.layers.activations import quantize_tokens, quantize_tokens_fp8, quantize_tokens_int8
from llmopt.layers.modules import QuantLinear
from llmopt.layers.types import FloatQuantized, Int8Quantized

_EMPTY = torch.empty(0)


class W8Linear(QuantLinear):
    """weight [out, in] (fp8 or int8) and weight_scale [out, 1] or [1]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, kind: str, per_channel: bool,
                 activations: str) -> None:
        super().__init__(in_features, out_features, bias)
        self.kind, self.activations = kind, activations       # kind: "fp8" | "int8"
        self._gpu_ok = True
        dtype = torch.float8_e4m3fn if kind == "fp8" else torch.int8
        self._declare("weight", (out_features, in_features), dtype)
        self._declare("weight_scale", (out_features, 1) if per_channel else (1,), torch.float32)

    def finish_loading(self) -> None:
        self._check_loaded()

    def _cpu_matmul(self, x2: torch.Tensor, unit: bool = False) -> torch.Tensor:
        """x2 [M, K] float32 @ (w8 * s)^T on the CPU; unit: @ w8^T (int8 codes times integer
        activations sum exactly in float32, so W8A8 rounds as the reference does)."""
        s = self.weight_scale
        if unit:
            s = torch.ones(self.out_features, 1)
        elif not (s.dtype == torch.float32 and s.dim() == 2 and s.is_contiguous()):   # else [out, 1] as is
            s = s.float().reshape(-1, 1)
            s = (s.expand(self.out_features, 1) if s.shape[0] == 1 else s).contiguous()
        if self.kind == "fp8":
            return cpu_quant.f8_gemm(x2, self.weight.view(torch.uint8), s)
        return cpu_quant.w8_gemm(x2, self.weight, s, _EMPTY, self.in_features)

    def canonical(self):
        if self.kind == "fp8":
            return FloatQuantized(self.weight, self.weight_scale, self.activations, self.bias)
        return Int8Quantized(self.weight, self.weight_scale, self.activations, self.bias)

    def _w_scale_row(self) -> torch.Tensor:
        """Weight scales as a float32 row [1, out]."""
        return self.weight_scale.float().reshape(1, -1).expand(1, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations != "dynamic":
            return self._weight_only(x)
        x2 = x.reshape(-1, self.in_features)
        y = None
        if x.is_cuda and self._gpu_ok:
            try:
                y = self._gpu_w8a8(x2)
            except RuntimeError:       # a GPU or shape torch's fp8/int8 GEMMs refuse: same math in float32
                self._gpu_ok = False
        if y is None:
            y = self._emulated_w8a8(x2)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _weight_only(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:   # no cached copy on a GPU: memory is what the 8-bit weight saves
            w = (self.weight.to(x.dtype) * self.weight_scale.to(x.dtype))
            return F.linear(x, w, self._bias(x.dtype))
        return cpu_quant.linear_2d(x, self._cpu_matmul, self.out_features, self.bias)

    def _emulated_w8a8(self, x2: torch.Tensor) -> torch.Tensor:
        xq, sx = quantize_tokens(x2, self.kind)
        if not x2.is_cuda:
            return self._cpu_matmul(xq.float().contiguous(), unit=True) * sx * self._w_scale_row()
        acc = xq.float() @ self.weight.float().t()
        return acc * sx * self._w_scale_row()

    def _gpu_w8a8(self, x2: torch.Tensor) -> torch.Tensor | None:
        m, k = x2.shape
        n = self.out_features
        if self.kind == "fp8":
            if k % 16 or n % 16:
                return None
            xq, sx = quantize_tokens_fp8(x2)
            out_dtype = x2.dtype if x2.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
            return torch._scaled_mm(xq, self.weight.t(), scale_a=sx, scale_b=self._w_scale_row().contiguous(),
                                    out_dtype=out_dtype)
        if k % 8 or n % 8:
            return None
        xq, sx = quantize_tokens_int8(x2)
        pad = max(0, 17 - m)                      # torch._int_mm wants more than 16 rows
        if pad:
            xq = F.pad(xq, (0, 0, 0, pad))
        acc = torch._int_mm(xq, self.weight.t())[:m]
        return acc.float() * sx * self._w_scale_row()

    def extra_repr(self) -> str:
        return super().extra_repr() + f", kind={self.kind}, activations={self.activations}"


def int8_rows(w: torch.Tensor, rows_per_slice: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of a float matrix [V, H]: (codes int8 [V, H], scales float32 [V]),
    a slice of rows at a time (no float32 copy of the whole table)."""
    codes = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(w.shape[0], dtype=torch.float32)
    for a in range(0, w.shape[0], rows_per_slice):
        part = w[a:a + rows_per_slice].detach().float()
        s = (part.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        codes[a:a + part.shape[0]] = torch.round(part / s[:, None]).clamp(-127, 127).to(torch.int8)
        scales[a:a + part.shape[0]] = s
    return codes, scales


class Int8Head(nn.Module):
    """The LM head in int8 per output row: logits = x @ (codes * s)^T through cpu_quant.w8_gemm."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("scales_col", scales[:, None].contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            w = self.codes.to(x.dtype) * self.scales_col.to(x.dtype)
            return F.linear(x, w)
        return cpu_quant.linear_2d(x, lambda x2: cpu_quant.w8_gemm(x2, self.codes, self.scales_col, _EMPTY,
                                                                  self.in_features), self.out_features, None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row"


class Int8Embedding(nn.Module):
    """A tied embedding read from the int8 head's table: rows gathered in int8, then scaled."""

    def __init__(self, head: Int8Head, dtype: torch.dtype) -> None:
        super().__init__()
        self.head = [head]          # not a submodule: the head owns the table
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.codes.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.head[0]
        if ids.is_cuda:
            out = h.codes[ids].to(self.dtype) * h.scales[ids, None].to(self.dtype)
            return out
        return cpu_quant.w8_rows(ids, h.codes, h.scales).to(self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 rows of the tied LM head"
