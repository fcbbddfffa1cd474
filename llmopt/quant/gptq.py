"""GPTQ (Frantar et al., 2022): quantize a Linear weight column by column, spreading each column's
rounding error over the columns not yet quantized through the inverse Hessian of the layer's
least-squares objective ||XWᵀ - XŴᵀ||², H = 2XᵀX over the calibration tokens.

Steps: dampen H (damp · mean diag), take the upper Cholesky factor of H⁻¹, quantize in blocks of
128 columns with the error pushed inside the block at once and to the rest lazily after the block;
with act-order the columns go by decreasing diag(H) (`group`: groups formed in that order, g_idx maps
each column to its group; `static`: natural groups with scales fixed up front, no g_idx).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt import defaults
from llmopt.errors import LLMOptError
from llmopt.quant.config import act_order_mode
from llmopt.quant.rtn import check_group_size, group_params
from llmopt.layers.types import IntQuantized


class HessianAccumulator:
    """H = 2/n Σ x xᵀ over the n calibration tokens seen so far. The sum is kept in float32 (as
    GPTQModel and llm-compressor keep it): on the CPU a float64 xᵀx costs twice the time, and the
    sum of 65k tokens' outer products loses nothing GPTQ's dampening does not dwarf. For wide inputs
    (an MLP's down_proj) only the upper block triangle is accumulated, in 4 row blocks: 5/8 of the
    multiply-adds, mirrored once when H is read."""

    def __init__(self, in_features: int, device=None, dtype: torch.dtype = torch.float32) -> None:
        self.sum = torch.zeros(in_features, in_features, dtype=dtype, device=device)
        self.n = 0
        k = 4 if in_features >= defaults.GPTQ_HESSIAN_BLOCKED_FROM else 1
        self.edges = [in_features * i // k for i in range(k + 1)]

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.sum.dtype)
        if x.shape[0] == 0:
            return
        e = self.edges
        for a, b in zip(e[:-1], e[1:]):
            self.sum[a:b, a:].addmm_(x[:, a:b].T, x[:, a:])
        self.n += x.shape[0]

    @property
    def H(self) -> torch.Tensor:
        s = self.sum
        if len(self.edges) > 2:
            upper = torch.zeros_like(s, dtype=torch.bool)
            for a, b in zip(self.edges[:-1], self.edges[1:]):
                upper[a:b, a:] = True
            s = torch.where(upper, s, s.T)
        return s * (2.0 / max(self.n, 1))


@dataclass
class GPTQResult:
    quantized: IntQuantized
    loss: float                    # Σ (w - q)² / [H⁻¹]_jj², the objective's proxy GPTQ reports


def gptq_quantize(w: torch.Tensor, H: torch.Tensor, bits: int, group_size: int, sym: bool,
                  damp: float = defaults.GPTQ_DAMP, act_order: "str | bool" = "none",
                  block: int = defaults.GPTQ_BLOCK, bias: torch.Tensor | None = None,
                  scale_dtype: torch.dtype | None = None) -> GPTQResult:
    """Quantize w [out, in] against H; see _gptq. Runs on one thread: its column loop is thousands
    of small ops and its factorizations are small, so fork/join would cost more than it saves
    (and under load, far more)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _gptq(w, H, bits, group_size, sym, damp, act_order, block, bias, scale_dtype)
    finally:
        torch.set_num_threads(threads)


def _gptq(w, H, bits, group_size, sym, damp, act_order, block, bias, scale_dtype) -> GPTQResult:
    """Quantize w [out, in] against the Hessian H [in, in] of its inputs.

    act_order: `none` (columns in order; each group's scale from its columns as updated so far),
    `group` (columns by decreasing diag(H), groups formed in that order: g_idx permutes, GPTQModel's
    desc_act) or `static` (columns by decreasing diag(H), but each column keeps its natural group,
    whose scale is taken from the original weights up front: act-order's accuracy with a plain
    sequential layout, llm-compressor's default)."""
    mode = act_order_mode(act_order)
    out_f, in_f = w.shape
    gs = check_group_size(in_f, group_size)
    W = w.detach().to(torch.float32).clone()
    H = H.to(torch.float32).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    n_groups = in_f // gs
    # each group's scale and zero as one contiguous row ([groups, out]): the column loop reads one per column
    S, Z = torch.zeros(n_groups, out_f), torch.zeros(n_groups, out_f)
    perm = None
    col_group = torch.arange(in_f) // gs       # the group of the column at each processing position
    if mode == "static":                       # all known up front, from the original weights
        s0, z0 = group_params(W.reshape(out_f, n_groups, gs), bits, sym, scale_dtype)
        S, Z = s0[..., 0].t().contiguous(), z0[..., 0].t().contiguous()
    if mode in ("static", "group"):
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
        if mode == "static":
            col_group = col_group[perm]
    Hinv = _inverse_cholesky_upper(H, damp)

    # Columns are rows of WT [in, out] (contiguous), so each step touches contiguous memory; the
    # column loop is thousands of small ops, so each writes in place and nothing is recomputed.
    WT = W.t().contiguous()
    QT = torch.empty_like(WT)
    maxq = 2 ** bits - 1
    group_of = col_group.tolist()
    dq = torch.empty(out_f)
    loss = 0.0
    for b0 in range(0, in_f, block):
        b1 = min(b0 + block, in_f)
        W1 = WT[b0:b1].clone()
        Err1 = torch.empty_like(W1)
        Hinv1 = Hinv[b0:b1, b0:b1]
        d = torch.diagonal(Hinv1).clone()
        Hs = Hinv1 / d[:, None]            # row i scaled by 1/Hinv[i, i]: the in-block update weights
        for i in range(b1 - b0):
            col = b0 + i
            if mode != "static" and col % gs == 0:
                # the group's parameters from its columns as updated so far (in-block ones from W1)
                grp = torch.cat([W1[i:], WT[b1:]])[:gs]
                S[col // gs], Z[col // gs] = (t[:, 0] for t in group_params(grp.t(), bits, sym, scale_dtype))
            g = group_of[col]
            w, s, z, q = W1[i], S[g], Z[g], QT[col]
            torch.div(w, s, out=q).round_().add_(z).clamp_(0, maxq)
            torch.sub(q, z, out=dq).mul_(s)
            e = torch.sub(w, dq, out=Err1[i])                 # w − ŵ; divided by Hinv[i, i] below
            W1[i:].addr_(Hs[i, i:], e, alpha=-1)              # W1[j] −= Hinv[i, j] / Hinv[i, i] · (w − ŵ)
        Err1.div_(d[:, None])
        loss += float(Err1.pow(2).sum())
        if b1 < in_f:
            WT[b1:].addmm_(Hinv[b0:b1, b1:].t(), Err1, alpha=-1)
    scales, zeros = S.t().contiguous(), Z.t().contiguous()
    Q = QT.t()

    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        Q = Q[:, inv]
        if mode == "group":
            g_idx = (torch.arange(in_f) // gs)[inv].to(torch.int32)
    qt = IntQuantized(qweight=Q.to(torch.int32), scales=scales, zeros=zeros.to(torch.int32), bits=bits,
                      group_size=group_size, sym=sym, g_idx=g_idx, bias=bias)
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
