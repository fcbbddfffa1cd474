"""Host side of the Triton paged attention (kernels: triton_attention_kernels.py).

A batch with one query per sequence (pure decode: `q.shape[0] == num_seqs`) runs the decode kernel,
split over the context when there are too few (sequence, kv head) pairs to fill the GPU; anything
else (prefill, chunked prefill, decode mixed with prefill) runs the varlen kernel. Neither reads
lengths back to the host, so a step never synchronizes here. Contract: every sequence of the batch
has at least one query row. kivi2 (`pages=`): the caches are the full-precision residual, read
for each sequence's blocks from quant_blocks[s] on; the blocks before come from the 2-bit pages.
"""

from __future__ import annotations

import torch
import triton

from llmopt.cache.kivi import key_page_bytes, value_page_bytes
from llmopt.errors import UserInputError
from llmopt.kernels import triton_attention_kernels as K
from llmopt.kernels.reference import _check_int8_scales

LOG2E = 1.4426950408889634


def kv_mode(cache: torch.Tensor, kv_dtype: str) -> int:
    if kv_dtype == "int4":
        return K.KV_Q4
    if kv_dtype == "int8":
        return K.KV_INT8
    if cache.dtype == torch.float8_e4m3fn:
        return K.KV_FP8E4
    if cache.dtype == torch.float8_e5m2:
        return K.KV_FP8E5
    return K.KV_PLAIN


def as_loadable(cache: torch.Tensor) -> torch.Tensor:
    """fp8 caches travel as uint8 bytes; the kernels bitcast them back."""
    return cache.view(torch.uint8) if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else cache


def _pow2(n: int, at_least: int = 16) -> int:
    return max(at_least, triton.next_power_of_2(n))


def _check_pages(pages, key_cache: torch.Tensor, value_cache: torch.Tensor, num_seqs: int):
    """kivi2's (key_pages, value_pages, quant_blocks), checked against the residual caches."""
    key_pages, value_pages, quant_blocks = pages
    _, group, hkv, d = key_cache.shape
    if key_cache.dtype not in (torch.float32, torch.bfloat16, torch.float16) or value_cache.dtype != key_cache.dtype:
        raise UserInputError(f"kivi2's residual cache must be float32, bfloat16 or float16, got {key_cache.dtype}")
    for name, p, width in (("key", key_pages, key_page_bytes(group, d)),
                           ("value", value_pages, value_page_bytes(group, d))):
        if p.dtype != torch.uint8 or p.dim() != 3 or p.shape[1:] != (hkv, width):
            raise UserInputError(f"kivi2 {name} pages must be uint8 [blocks, {hkv}, {width}] for group size {group} "
                                 f"and head_dim {d}, got {p.dtype} {list(p.shape)}")
        if not p.is_contiguous() or p.data_ptr() % 2:   # fp16 scales are read in place
            raise UserInputError(f"kivi2 {name} pages must be contiguous and 2-byte aligned")
    if quant_blocks.shape != (num_seqs,):
        raise UserInputError(f"kivi2 needs quant_blocks [{num_seqs}], got {list(quant_blocks.shape)}")
    return key_pages, value_pages, quant_blocks


def pick_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Context splits for decode: enough programs for about two waves of the SMs, each split
    covering at least 256 positions of the longest possible context (host-known: table width)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = num_seqs * num_kv_heads
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(max_context, 256), 32))


def paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, window, kv_dtype,
                    k_scale, v_scale, k_scale_cache=None, v_scale_cache=None, *, num_splits: int | None = None,
                    block_n: int | None = None, block_m: int | None = None, pages=None) -> torch.Tensor:
    """Same contract as reference.paged_attention; the keyword-only tile knobs are for tests. pages:
    kivi2's (key_pages, value_pages, quant_blocks [S]), the caches being its residual."""
    _check_int8_scales(kv_dtype, k_scale_cache, v_scale_cache)
    nq, hq, d = q.shape
    _, page, hkv, _ = key_cache.shape
    if hq % hkv:
        raise UserInputError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    out_dtype = q.dtype
    if q.dtype == torch.float64:  # tl.dot has no float64: compute in float32
        q = q.float()
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if nq == 0 or num_seqs == 0:
        return out.to(out_dtype)
    g = hq // hkv
    mode = kv_mode(key_cache, kv_dtype)
    kc, vc = as_loadable(key_cache), as_loadable(value_cache)
    ksc = k_scale_cache if mode == K.KV_INT8 else kc  # unused pointer otherwise
    vsc = v_scale_cache if mode == K.KV_INT8 else vc
    qb = seq_lens   # unused pointer unless kivi2
    if pages is not None:
        mode = K.KV_KIVI
        ksc, vsc, qb = _check_pages(pages, key_cache, value_cache, num_seqs)
    cuda = q.is_cuda
    # float32 dots for float32 queries, and always in the CPU interpreter, whose bf16 tl.dot
    # multiplies raw bits; half-precision dots (fp32 accumulation) otherwise
    common = dict(HKV=hkv, D=d, D_PAD=_pow2(d), PAGE=page, KV_MODE=mode, USE_WINDOW=window is not None,
                  DOT_IEEE=q.dtype == torch.float32 or not cuda)
    bn = block_n or (64 if cuda else 16)
    args = (float(k_scale), float(v_scale), scale * LOG2E, int(window or 0))
    if nq == num_seqs:
        splits = num_splits or pick_splits(num_seqs, hkv, block_tables.shape[1] * page, q.device)
        part = ml = out
        if splits > 1:
            part = torch.empty((num_seqs, hq, splits, d), dtype=torch.float32, device=q.device)
            ml = torch.empty((num_seqs, hq, splits, 2), dtype=torch.float32, device=q.device)
        K._decode_kernel[(num_seqs, hkv, splits)](
            q, kc, vc, ksc, vsc, block_tables, seq_lens, query_start_loc, qb, out, part, ml,
            q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1), *args, splits,
            G=g, G_PAD=_pow2(g), BLOCK_N=bn, SPLIT=splits > 1, **common)
        if splits > 1:
            K._merge_kernel[(num_seqs, hq)](part, ml, query_start_loc, out, out.stride(0), out.stride(1), splits,
                                            HQ=hq, D=d, D_PAD=_pow2(d), SPLITS_PAD=_pow2(splits, 2))
    else:
        bm = max(block_m or (64 if cuda else 16), _pow2(g))
        bq = bm // g
        K._varlen_kernel[(nq // bq + num_seqs, hkv)](
            q, kc, vc, ksc, vsc, block_tables, seq_lens, query_start_loc, qb, out,
            q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1), *args, num_seqs,
            G=g, BLOCK_M=bm, BLOCK_Q=bq, BLOCK_N=bn, **common)
    return out.to(out_dtype)
