"""Fused Triton RMSNorm and rotary embedding.

Both replace a chain of small PyTorch ops (cast, square, mean, rsqrt, multiplies; or slice, negate,
cat, two multiplies and an add) by one pass over the data, which is what pays at decode batch sizes
where every op is a kernel launch. Numerics follow reference.py: RMS statistics in float32, the
normalized value cast back to the input dtype before the weight multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as reference.rms_norm."""
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, x2.stride(0), y.stride(0), n, float(eps),
                                         BLOCK=block, num_warps=min(max(block // 256, 1), 8))
    return y.view(shape)


@triton.jit
def _rotate(x_ptr, o_ptr, stride_n, stride_h, n, c1, c2, s1, s2, heads: tl.constexpr, HALF: tl.constexpr,
            H_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < HALF)
    src = x_ptr + n * stride_n + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    dst = o_ptr + (n * heads + offs_h[:, None]) * (2 * HALF) + offs_d[None, :]
    tl.store(dst, (x1f * c1[None, :] - x2f * s1[None, :]).to(x1.dtype), mask=mask)
    tl.store(dst + HALF, (x2f * c2[None, :] + x1f * s2[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, stride_qn, stride_qh, stride_kn, stride_kh,
                   stride_c, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                   HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    """One program per token: rotate all its q and k heads with the token's cos/sin row."""
    n = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    md = offs_d < HALF
    row = n * stride_c + offs_d
    c1 = tl.load(cos_ptr + row, mask=md, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row + HALF, mask=md, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row, mask=md, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF, mask=md, other=0.0).to(tl.float32)
    _rotate(q_ptr, qo_ptr, stride_qn, stride_qh, n, c1, c2, s1, s2, HQ, HALF, HQ_PAD, HALF_PAD)
    _rotate(k_ptr, ko_ptr, stride_kn, stride_kh, n, c1, c2, s1, s2, HKV, HALF, HKV_PAD, HALF_PAD)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Same contract as reference.rotary: q [N, Hq, D], k [N, Hkv, D], cos/sin [N, D]."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    cos, sin = cos.reshape(n, d).contiguous(), sin.reshape(n, d).contiguous()
    qo = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((n, hkv, d), dtype=k.dtype, device=k.device)
    if n:
        half = d // 2
        _rotary_kernel[(n,)](q, k, cos, sin, qo, ko, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                             cos.stride(0), HQ=hq, HKV=hkv, HALF=half, HQ_PAD=triton.next_power_of_2(hq),
                             HKV_PAD=triton.next_power_of_2(hkv), HALF_PAD=triton.next_power_of_2(half))
    return qo, ko
