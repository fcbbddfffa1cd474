"""Triton paged-attention kernels (host side: triton_attention.py): a GQA-aware decode kernel
(split over the context for long sequences) and a varlen prefill/extend kernel, both reading K/V
straight from the paged cache.

Both kernels work on one kv head and its whole query-head group at once, so each K/V tile is loaded
once per group (the GQA saving). A tile of keys is BLOCK_N consecutive context positions; each
position finds its page through the block table, so any page size (1, 16, ...) works. fp8 caches are
read as bytes and bitcast, int8 codes are multiplied by their per-(token, head) scale on load, int4
rows are q4_0 blocks (per 32 values an fp16 scale, then 16 bytes of nibbles) decoded on load.
kivi2 (KV_KIVI): the caches are the full-precision residual and ks_ptr/vs_ptr its 2-bit key/value
pages (layout: llmopt/kernels/kivi.py); a position of block b < quant_blocks[s] (qb_ptr) is decoded
from the page its table entry names, any other read from the residual block it names, per position,
so a tile may straddle the two.
"""

from __future__ import annotations

import triton
import triton.language as tl

KV_PLAIN, KV_FP8E4, KV_FP8E5, KV_INT8, KV_Q4, KV_KIVI = 0, 1, 2, 3, 4, 5  # KV_MODE: how a cache's elements are dequantized


@triton.jit
def _load_kv(cache_ptr, scale_ptr, slots, valid_n, h, offs_d, mask_d, kv_scale,
             HKV: tl.constexpr, D: tl.constexpr, KV_MODE: tl.constexpr):
    """Dequantized [BLOCK_N, D_PAD] float32 tile of kv head h at the given slots."""
    if KV_MODE == 4:   # q4_0: value d of a row is block d // 32's nibble (d % 32 < 16: low, else high)
        m = valid_n[:, None] & mask_d[None, :]
        blk = cache_ptr + (slots[:, None] * HKV + h) * (D // 32 * 18) + (offs_d[None, :] // 32) * 18
        w = offs_d[None, :] % 32
        raw = tl.load(blk + 2 + w % 16, mask=m, other=0).to(tl.int32)
        q = (raw >> ((w // 16) * 4)) & 15
        lo = tl.load(blk, mask=m, other=0).to(tl.uint16)
        hi = tl.load(blk + 1, mask=m, other=0).to(tl.uint16)
        d = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        return (q - 8).to(tl.float32) * d
    ptrs = cache_ptr + (slots[:, None] * HKV + h) * D + offs_d[None, :]
    raw = tl.load(ptrs, mask=valid_n[:, None] & mask_d[None, :], other=0)
    if KV_MODE == 1:
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * kv_scale
    elif KV_MODE == 2:
        x = raw.to(tl.float8e5, bitcast=True).to(tl.float32) * kv_scale
    elif KV_MODE == 3:
        s = tl.load(scale_ptr + slots * HKV + h, mask=valid_n, other=0.0)
        x = raw.to(tl.float32) * s[:, None]
    else:
        x = raw.to(tl.float32)
    return x


@triton.jit
def _load_kivi(cache_ptr, page_ptr, ids, t, quant, resid, h, offs_d, mask_d,
               IS_KEY: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr):
    """kivi2: [BLOCK_N, D_PAD] float32 tile of kv head h. Position n is offset t[n] of block ids[n]:
    a 2-bit page (quant) or a residual block (resid); positions in neither stay 0."""
    m = mask_d[None, :]
    c = offs_d[None, :]
    res = tl.load(cache_ptr + ((ids * PAGE + t)[:, None] * HKV + h) * D + c, mask=resid[:, None] & m, other=0)
    mq = quant[:, None] & m
    if IS_KEY:   # per channel c: fp16 scale[D], fp16 zero[D], codes [PAGE][D / 4]
        base = page_ptr + (ids * HKV + h)[:, None] * (4 * D + PAGE * D // 4)
        sz = 2 * c
        zero_at = 2 * D
        codes_at = 4 * D
    else:        # per (token t, group of V channels): fp16 scale[PAGE][D / V], fp16 zero[PAGE][D / V], codes
        V: tl.constexpr = min(PAGE, D)
        base = page_ptr + (ids * HKV + h)[:, None] * (4 * PAGE * (D // V) + PAGE * D // 4)
        sz = 2 * (t[:, None] * (D // V) + c // V)
        zero_at = 2 * PAGE * (D // V)
        codes_at = 4 * PAGE * (D // V)
    scale = tl.load((base + sz).to(tl.pointer_type(tl.float16)), mask=mq, other=0.0).to(tl.float32)
    zero = tl.load((base + zero_at + sz).to(tl.pointer_type(tl.float16)), mask=mq, other=0.0).to(tl.float32)
    byte = tl.load(base + codes_at + t[:, None] * (D // 4) + c // 4, mask=mq, other=0).to(tl.int32)
    code = (byte >> (2 * (c % 4))) & 3
    return tl.where(quant[:, None], code.to(tl.float32) * scale + zero, res.to(tl.float32))


@triton.jit
def _attend(q, acc, m_i, l_i, q_pos, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, qb, j_start, j_end, h,
            k_scale, v_scale, qk_scale, window, offs_d, mask_d,
            HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
            KV_MODE: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_IEEE: tl.constexpr):
    """Online-softmax accumulation of keys [j_start, j_end) for the query rows q (positions q_pos).
    Scores are kept in log2 units (qk_scale includes log2(e)). qb: kivi2's quantized blocks (else unused)."""
    for j0 in range(j_start, j_end, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        valid_n = offs_n < j_end
        page = tl.load(table_ptr + offs_n // PAGE, mask=valid_n, other=0).to(tl.int64)
        if KV_MODE == 5:
            quant = valid_n & (offs_n // PAGE < qb)
            resid = valid_n & (offs_n // PAGE >= qb)
            t = offs_n % PAGE
            k = _load_kivi(k_ptr, ks_ptr, page, t, quant, resid, h, offs_d, mask_d, True, HKV, D, PAGE)
            v = _load_kivi(v_ptr, vs_ptr, page, t, quant, resid, h, offs_d, mask_d, False, HKV, D, PAGE)
        else:
            slots = page * PAGE + offs_n % PAGE
            k = _load_kv(k_ptr, ks_ptr, slots, valid_n, h, offs_d, mask_d, k_scale, HKV, D, KV_MODE)
            v = _load_kv(v_ptr, vs_ptr, slots, valid_n, h, offs_d, mask_d, v_scale, HKV, D, KV_MODE)
        if DOT_IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = s * qk_scale
        allowed = valid_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (q_pos[:, None] - offs_n[None, :] < window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    return acc, m_i, l_i


# runtime sizes that change from step to step are not specialized (no recompiles mid-run)
@triton.jit(do_not_specialize=["stride_bt", "window", "num_splits"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, qsl_ptr, qb_ptr, o_ptr, part_ptr, ml_ptr,
                   stride_qn, stride_qh, stride_bt, stride_on, stride_oh, k_scale, v_scale, qk_scale, window,
                   num_splits, G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                   G_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, KV_MODE: tl.constexpr,
                   USE_WINDOW: tl.constexpr, DOT_IEEE: tl.constexpr, SPLIT: tl.constexpr):
    """One program per (sequence, kv head[, context split]): the head group's single query row."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + s)
    row = tl.load(qsl_ptr + s).to(tl.int64)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < D
    mask_g = offs_g < G
    heads = h * G + offs_g
    q = tl.load(q_ptr + row * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if DOT_IEEE:
        q = q.to(tl.float32)
    q_pos = tl.zeros([G_PAD], dtype=tl.int32) + (length - 1)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(length - window, 0)
    chunk = tl.cdiv(tl.cdiv(length - lo, num_splits), BLOCK_N) * BLOCK_N
    j_start = lo + split * chunk
    j_end = tl.minimum(j_start + chunk, length)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    qb = 0
    if KV_MODE == 5:
        qb = tl.load(qb_ptr + s)
    acc, m_i, l_i = _attend(q, acc, m_i, l_i, q_pos, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr + s * stride_bt, qb,
                            j_start, j_end, h, k_scale, v_scale, qk_scale, window, offs_d, mask_d,
                            HKV, D, PAGE, BLOCK_N, KV_MODE, USE_WINDOW, DOT_IEEE)
    out_mask = mask_g[:, None] & mask_d[None, :]
    if SPLIT:
        # partial results: acc / l per split, and (m, l) to merge them in _merge_kernel
        hq = HKV * G
        base = (s * hq + heads) * num_splits + split
        tl.store(part_ptr + base[:, None] * D + offs_d[None, :], acc / tl.maximum(l_i, 1e-30)[:, None], mask=out_mask)
        tl.store(ml_ptr + base * 2, m_i, mask=mask_g)
        tl.store(ml_ptr + base * 2 + 1, l_i, mask=mask_g)
    else:
        o = acc / l_i[:, None]
        tl.store(o_ptr + row * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(part_ptr, ml_ptr, qsl_ptr, o_ptr, stride_on, stride_oh, num_splits,
                  HQ: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Combine the context splits of one (sequence, query head) by their softmax masses."""
    s = tl.program_id(0)
    hq = tl.program_id(1)
    offs_p = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_p = offs_p < num_splits
    base = (s * HQ + hq) * num_splits + offs_p
    m = tl.load(ml_ptr + base * 2, mask=mask_p, other=float("-inf"))
    lsum = tl.load(ml_ptr + base * 2 + 1, mask=mask_p, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(lsum > 0, lsum * tl.exp2(m - m_max), 0.0)
    part = tl.load(part_ptr + base[:, None] * D + offs_d[None, :], mask=mask_p[:, None] & (offs_d[None, :] < D),
                   other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    row = tl.load(qsl_ptr + s).to(tl.int64)
    tl.store(o_ptr + row * stride_on + hq * stride_oh + offs_d, o.to(o_ptr.dtype.element_ty), mask=offs_d < D)


@triton.jit(do_not_specialize=["stride_bt", "window", "num_seqs"])
def _varlen_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, qsl_ptr, qb_ptr, o_ptr,
                   stride_qn, stride_qh, stride_bt, stride_on, stride_oh, k_scale, v_scale, qk_scale, window,
                   num_seqs, G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                   KV_MODE: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_IEEE: tl.constexpr):
    """One program per (query tile, kv head). A tile is BLOCK_Q queries of one sequence times the
    G heads of the group (BLOCK_M rows). Sequence s's tiles start at qsl[s] // BLOCK_Q + s, so the
    grid needs no host-side lengths; a binary search finds the tile's sequence."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first <= t, mid + 1, lo)
        hi = tl.where(first <= t, hi, mid)
    s = lo - 1
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    local = t - (q_start // BLOCK_Q + s)
    if local * BLOCK_Q >= q_len:
        return
    length = tl.load(lens_ptr + s)
    ctx = length - q_len
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < D
    qi = local * BLOCK_Q + offs_m // G
    heads = h * G + offs_m % G
    row_ok = (offs_m < BLOCK_Q * G) & (qi < q_len)
    rows = (q_start + qi).to(tl.int64)
    io_mask = row_ok[:, None] & mask_d[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :], mask=io_mask,
                other=0.0)
    if DOT_IEEE:
        q = q.to(tl.float32)
    q_pos = ctx + qi
    j_end = tl.minimum(length, ctx + (local + 1) * BLOCK_Q)
    j_start = 0
    if USE_WINDOW:
        j_start = tl.maximum(ctx + local * BLOCK_Q - window + 1, 0)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    qb = 0
    if KV_MODE == 5:
        qb = tl.load(qb_ptr + s)
    acc, m_i, l_i = _attend(q, acc, m_i, l_i, q_pos, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr + s * stride_bt, qb,
                            j_start, j_end, h, k_scale, v_scale, qk_scale, window, offs_d, mask_d,
                            HKV, D, PAGE, BLOCK_N, KV_MODE, USE_WINDOW, DOT_IEEE)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + rows[:, None] * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=io_mask)
