"""AWQ (Lin et al., 2023), the parts AutoAWQ runs per decoder layer, re-derived:

1. per-input-channel scales s for a group of Linears sharing one input, searched over a grid of α:
   s = mean|x|^α (or, with duo scaling, mean|x|^α / mean|ŵ|^(1−α), ŵ = |w| / group absmax),
   normalised by sqrt(max(s)·min(s)); the loss is the MSE of a module's output with the
   Linears replaced by Q(W·s)/s against the float output;
2. the best s is folded into the op before (a norm's weight or a Linear's output rows), so the
   float function is unchanged, and the Linears' weights are multiplied by it;
3. a clipping search: for each (row, group) the absmax shrunk by up to 50% that minimises the
   output error of the quantized group on a sample of tokens.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from llmopt.quant.rtn import fake_quantize


def weight_mean_abs(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Mean over rows of |w| normalised by its group's absmax, per input channel (duo scaling)."""
    w = torch.cat([w.float() for w in weights], dim=0)
    out_f, in_f = w.shape
    gs = in_f if group_size == -1 else group_size
    wg = w.abs().reshape(out_f, in_f // gs, gs)
    wg = wg / (wg.amax(dim=-1, keepdim=True) + 1e-6)
    return wg.reshape(out_f, in_f).mean(0)


@torch.no_grad()
def search_scales(x_mean: torch.Tensor, linears: list[nn.Linear], inspect: Callable[[], torch.Tensor],
                  bits: int, group_size: int, sym: bool, grid: int = 20, duo: bool = False,
                  scale_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, float]:
    """Best per-channel scales for `linears` (which all read the input whose channel means are
    x_mean); `inspect()` recomputes the module output on the sample with the Linears as they are now."""
    originals = [lin.weight.data.clone() for lin in linears]
    reference = inspect()
    w_mean = weight_mean_abs(originals, group_size) if duo else None
    best_err, best_s = float("inf"), torch.ones_like(x_mean)
    for k in range(grid):
        alpha = k / grid
        if duo:
            s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        else:
            s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        for lin, w in zip(linears, originals):
            lin.weight.data = fake_quantize(w * s, bits, group_size, sym, scale_dtype) / s
        err = float((inspect() - reference).float().pow(2).mean())
        if err < best_err:
            best_err, best_s = err, s.clone()
    for lin, w in zip(linears, originals):
        lin.weight.data = w
    return best_s, best_err


@torch.no_grad()
def fold_scales(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """prev's output channels ÷ s (a norm's weight, or a Linear's rows and bias); the Linears'
    input columns × s. The float function of prev → linears is unchanged."""
    s = s.to(prev.weight.dtype)
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s[:, None])
        if prev.bias is not None:
            prev.bias.div_(s)
    else:
        prev.weight.div_(s)
    for lin in linears:
        lin.weight.mul_(s[None, :])


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int, sym: bool, grid: int = 20,
                max_shrink: float = 0.5, n_tokens: int = 512, row_batch: int = 256,
                scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-(row, group) clipping bounds [out, n_groups, 1] minimising the grouped output error."""
    out_f, in_f = w.shape
    gs = in_f if group_size == -1 else group_size
    x = x.reshape(-1, in_f).float()
    step = max(1, x.shape[0] // n_tokens)
    x = x[::step][:n_tokens].reshape(-1, in_f // gs, gs)                  # [tok, G, gs]
    bounds = []
    for r0 in range(0, out_f, row_batch):
        wb = w[r0:r0 + row_batch].float().reshape(-1, in_f // gs, gs)     # [rows, G, gs]
        amax = wb.abs().amax(dim=-1, keepdim=True)                          # [rows, G, 1]
        ref = torch.einsum("tgk,rgk->rgt", x, wb)                           # [rows, G, tok]
        best = amax.clone()
        best_err = torch.full_like(amax, float("inf"))
        for i in range(int(max_shrink * grid)):
            m = amax * (1 - i / grid)
            q = fake_quantize(torch.clamp(wb, -m, m).reshape(-1, in_f), bits, group_size, sym,
                              scale_dtype).reshape(wb.shape)
            err = (torch.einsum("tgk,rgk->rgt", x, q) - ref).pow(2).mean(dim=-1, keepdim=True)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, m, best)
        bounds.append(best)
    return torch.cat(bounds, dim=0)


@torch.no_grad()
def apply_clip(lin: nn.Linear, bounds: torch.Tensor, group_size: int) -> None:
    out_f, in_f = lin.weight.shape
    gs = in_f if group_size == -1 else group_size
    wg = lin.weight.reshape(out_f, in_f // gs, gs)
    lin.weight.copy_(torch.clamp(wg, -bounds, bounds).reshape(out_f, in_f))
