"""Runtime modules for 8-bit compressed-tensors checkpoints: FP8 e4m3 (float-quantized, or
naive-quantized when weight-only) and INT8 W8A8 (int-quantized).

W8A8 quantizes the activations per token, dynamically and symmetrically, as vLLM does
(`quant/activations.py`, the definition calibration simulates too), then y = (xq @ w8ᵀ) * s * s_w.
On CUDA through torch._scaled_mm (fp8, row-wise scales) and torch._int_mm (int8), on the CPU the
same arithmetic in float32. Weight-only FP8 dequantizes (cached on the CPU, per call on a GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmopt.quant.activations import quantize_tokens, quantize_tokens_fp8, quantize_tokens_int8
from llmopt.quant.modules import QuantLinear
from llmopt.quant.types import FloatQuantized, Int8Quantized

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
        if self._dense is None or self._dense.dtype != x.dtype:
            self._dense = self.canonical().dequantize(x.dtype)
        return F.linear(x, self._dense, self._bias(x.dtype))

    def _emulated_w8a8(self, x2: torch.Tensor) -> torch.Tensor:
        xq, sx = quantize_tokens(x2, self.kind)
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
