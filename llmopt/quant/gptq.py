"""GPTQ (Frantar et al., 2022): quantize a Linear weight column by column, spreading each column's
rounding error over the columns not yet quantized through the inverse Hessian of the layer's
least-squares objective ||XWᵀ - XŴᵀ||², H = 2XᵀX over the calibration tokens.

Steps: dampen H (damp · mean diag), take the upper Cholesky factor of H⁻¹, quantize in blocks of
128 columns with the error pushed inside the block at once and to the rest lazily after the block;
with act-order the columns go by decreasing diag(H) and g_idx maps each column to its group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt import defaults
from llmopt.errors import LLMOptError
from llmopt.quant.rtn import check_group_size, group_params, quantize_codes
from llmopt.quant.types import IntQuantized


class HessianAccumulator:
    """H = 2/n Σ x xᵀ over the n calibration tokens seen so far (a running mean, in float64)."""

    def __init__(self, in_features: int, device=None) -> None:
        self.H = torch.zeros(in_features, in_features, dtype=torch.float64, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.H.dtype)
        m = x.shape[0]
        if m == 0:
            return
        self.H *= self.n / (self.n + m)
        self.n += m
        x = x * (2.0 / self.n) ** 0.5
        self.H += x.T @ x


@dataclass
class GPTQResult:
    quantized: IntQuantized
    loss: float                    # Σ (w - q)² / [H⁻¹]_jj², the objective's proxy GPTQ reports


def gptq_quantize(w: torch.Tensor, H: torch.Tensor, bits: int, group_size: int, sym: bool,
                  damp: float = defaults.GPTQ_DAMP, act_order: bool = False,
                  block: int = defaults.GPTQ_BLOCK, bias: torch.Tensor | None = None,
                  scale_dtype: torch.dtype | None = None) -> GPTQResult:
    out_f, in_f = w.shape
    gs = check_group_size(in_f, group_size)
    W = w.detach().to(torch.float32).clone()
    H = H.to(torch.float32).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    Hinv = _inverse_cholesky_upper(H, damp)

    Q = torch.zeros_like(W)
    n_groups = in_f // gs
    scales = torch.zeros(out_f, n_groups)
    zeros = torch.zeros(out_f, n_groups)
    scale = zero = None
    loss = 0.0
    for b0 in range(0, in_f, block):
        b1 = min(b0 + block, in_f)
        W1 = W[:, b0:b1].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % gs == 0:
                # the group's parameters from its columns as updated so far (in-block ones from W1)
                g = torch.cat([W1[:, i:], W[:, b1:]], dim=1)[:, :gs]
                scale, zero = group_params(g, bits, sym, scale_dtype)
                scales[:, col // gs], zeros[:, col // gs] = scale[:, 0], zero[:, 0]
            wcol = W1[:, i:i + 1]
            q = quantize_codes(wcol, scale, zero, bits)
            Q[:, col:col + 1] = q
            d = Hinv1[i, i]
            err = (wcol - (q - zero) * scale) / d
            loss += float((err ** 2).sum())
            W1[:, i:] -= err @ Hinv1[i:i + 1, i:]
            Err1[:, i:i + 1] = err
        W[:, b1:] -= Err1 @ Hinv[b0:b1, b1:]

    g_idx = torch.arange(in_f) // gs
    if perm is not None:
        inv = torch.argsort(perm)
        Q = Q[:, inv]
        g_idx = g_idx[inv]
    qt = IntQuantized(qweight=Q.to(torch.int32), scales=scales, zeros=zeros.to(torch.int32), bits=bits,
                      group_size=group_size, sym=sym, g_idx=g_idx.to(torch.int32) if perm is not None else None,
                      bias=bias)
    return GPTQResult(qt, loss)


def _inverse_cholesky_upper(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + λI)⁻¹ with λ = damp · mean(diag H); more damping if needed."""
    mean_diag = torch.diag(H).mean()
    for factor in (1.0, 10.0, 100.0):
        Hd = H + torch.eye(H.shape[0]) * (damp * factor * mean_diag)
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            Hi = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hi, upper=True)
            if int(info) == 0:
                return U
    raise LLMOptError("GPTQ: the Hessian is not positive definite even with 100x dampening: "
                      "use more calibration samples or a larger --damp")
