"""Triton write of new K/V rows into the paged cache.

Quantization (fp8 clamp + cast, int8 rounding and per-(token, head) scales) happens in PyTorch,
exactly as the reference does it: an fp32 -> fp8 cast inside a kernel can only be verified on a GPU
(Triton 3.9's interpreter rounds it wrongly). The kernel then scatters the rows (fp8 as raw bytes),
and their int8 scales, to their slots in one launch for K and V, skipping negative (padding) slots
without reading them back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmopt.kernels.reference import _check_int8_scales, quantize_kv


@triton.jit
def _scatter_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, ksc_ptr, vsc_ptr, slot_ptr,
                    stride_kn, stride_kh, stride_vn, stride_vh,
                    HKV: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
                    HAS_SCALES: tl.constexpr):
    """One program per token: copy its [Hkv, D] K and V rows (cast to the cache dtype) to its slot."""
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < D)
    dst = slot * HKV * D + offs_h[:, None] * D + offs_d[None, :]
    k = tl.load(k_ptr + n * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + n * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)
    if HAS_SCALES:
        hm = offs_h < HKV
        tl.store(ksc_ptr + slot * HKV + offs_h, tl.load(ks_ptr + n * HKV + offs_h, mask=hm), mask=hm)
        tl.store(vsc_ptr + slot * HKV + offs_h, tl.load(vs_ptr + n * HKV + offs_h, mask=hm), mask=hm)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else x


def write_kv(key_cache, value_cache, k, v, slot_mapping, kv_dtype, k_scale, v_scale,
             k_scale_cache=None, v_scale_cache=None) -> None:
    """Same contract as reference.write_kv."""
    _check_int8_scales(kv_dtype, k_scale_cache, v_scale_cache)
    n = k.shape[0]
    if n == 0:
        return
    _, _, hkv, d = key_cache.shape
    if kv_dtype == "auto" and key_cache.element_size() > 1:
        kq, vq, ks, vs = k, v, None, None  # a plain copy; the kernel casts (never to fp8)
    else:
        kq, ks = quantize_kv(k, key_cache.dtype, kv_dtype, k_scale)
        vq, vs = quantize_kv(v, value_cache.dtype, kv_dtype, v_scale)
    kq, vq = (x if x.stride(-1) == 1 else x.contiguous() for x in (kq, vq))
    kc, vc = _bytes(key_cache), _bytes(value_cache)
    has_scales = ks is not None
    ks = ks.contiguous() if has_scales else kc
    vs = vs.contiguous() if has_scales else vc
    ksc = k_scale_cache if has_scales else kc
    vsc = v_scale_cache if has_scales else vc
    _scatter_kernel[(n,)](_bytes(kq), _bytes(vq), kc, vc, ks, vs, ksc, vsc, slot_mapping,
                          kq.stride(0), kq.stride(1), vq.stride(0), vq.stride(1),
                          HKV=hkv, D=d, H_PAD=triton.next_power_of_2(hkv), D_PAD=triton.next_power_of_2(d),
                          HAS_SCALES=has_scales)
