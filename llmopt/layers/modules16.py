"""16-bit float weights held as stored on the CPU (a bfloat16 or float16 checkpoint, `--dtype auto`).

The model computes in float32 (activations, norms, the KV cache) while its Linear and embedding
weights stay 16-bit: half the bytes to hold and to stream each decode step. The C++ kernels widen
the weights to float32 inside the loop (llmopt_cpu::f32_gemm; the C++ decode layers' KBF16 / KF16
linears), exactly: a 16-bit weight's products equal those of its float32 copy bit for bit. Where
autograd must flow through a linear (spec-tune's loss through the target's head) or the kernels
are not built, the weight is widened with torch for that call.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmopt.kernels import cpu_quant

DTYPES16 = (torch.bfloat16, torch.float16)


class Linear16(nn.Linear):
    """y = x @ W^T + b for float32 x, W held in bfloat16 / float16, b in float32."""

    held_in_own_dtype = ("weight",)   # load_weights keeps the weight in the module's dtype

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device=None) -> None:
        if dtype not in DTYPES16:
            raise ValueError(f"Linear16 holds bfloat16 or float16 weights, not {dtype}")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.weight.requires_grad_(False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=self.weight.device), requires_grad=False)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return cpu_quant.ops().f32_gemm(x2, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() and x.requires_grad) or cpu_quant.ops() is None or \
                self.in_features % 8 or not self.weight.is_contiguous():
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return cpu_quant.linear_2d(x, self._matmul, self.out_features, self.bias)


class Embedding16(nn.Embedding):
    """Token rows gathered from a 16-bit table and widened to float32 (the tied head shares it)."""

    held_in_own_dtype = ("weight",)

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device=None) -> None:
        if dtype not in DTYPES16:
            raise ValueError(f"Embedding16 holds a bfloat16 or float16 table, not {dtype}")
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.weight.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).float()


def holder_16bit(mod: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The 16-bit holder of a float nn.Linear or nn.Embedding (same shapes and device, unfilled)."""
    if type(mod) is nn.Embedding:
        return Embedding16(mod.num_embeddings, mod.embedding_dim, dtype, device=mod.weight.device)
    return Linear16(mod.in_features, mod.out_features, mod.bias is not None, dtype, device=mod.weight.device)


def convert_to_16bit(model: nn.Module, dtype: torch.dtype) -> int:
    """Before loading (on the meta device): every float nn.Linear and nn.Embedding of `model`
    becomes its 16-bit holder (a tied head keeps sharing the embedding's table); how many."""
    swaps = [(name, holder_16bit(mod, dtype)) for name, mod in model.named_modules()
             if type(mod) in (nn.Linear, nn.Embedding)]
    for name, new in swaps:
        model.set_submodule(name, new)
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and isinstance(getattr(model, "lm_head", None), Linear16):
        model.lm_head.weight = model.model.embed_tokens.weight
    return len(swaps)
