"""PyTorch reference path for the paged KV cache: quantized writes, varlen paged attention, RMSNorm
and rotary embedding. It is the CPU default and the oracle the Triton kernels are tested against.

Layout (docs/design.md, "Paged KV cache"): per layer `key_cache`/`value_cache` of shape
[num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is `block_id * block_size + offset`.
KV dtypes: `auto` (model dtype), `float32`/`bfloat16`/`float16` (rows cast, read widened),
`fp8`/`fp8_e4m3`, `fp8_e5m2` (per-tensor scales, stored = clamp(x / scale, ±max) cast to fp8) and
`int8` (symmetric per (token, kv head), scale = absmax / 127 kept in `k_scale_cache`/`v_scale_cache`
of shape [num_blocks, block_size, num_kv_heads]) and `int4` (llama.cpp's q4_0 blocks along
head_dim: per 32 values an fp16 scale d = the signed absmax / -8, then 16 bytes of codes q with
x = (q - 8) * d, value j in byte j's low nibble and value j + 16 in its high one; a head's row is
head_dim / 32 such 18-byte blocks, so the cache is uint8 [num_blocks, block_size, num_kv_heads,
head_dim / 32 * 18] and needs no scale tensors). `kivi2`: a full-precision residual written as a float
cache, and 2-bit pages read for each sequence's first `quant_blocks` blocks (llmopt/kernels/kivi.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmopt.errors import UserInputError
from llmopt.kernels import kivi
from llmopt.ggml_types import Q4_0_BYTES as Q4_BYTES, Q4_0_VALUES as Q4_VALUES, kv_int4_head_bytes

KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "kivi2")
FLOAT_KV = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}   # stored as cast
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
INT8_MAX = 127.0


def kv_cache_torch_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the cache tensors for a `--kv-cache-dtype` value."""
    if kv_dtype in ("auto", "kivi2"):   # kivi2: its full-precision residual's (the pages are uint8)
        return model_dtype
    if kv_dtype in FLOAT_KV:
        return FLOAT_KV[kv_dtype]
    if kv_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    if kv_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    if kv_dtype == "int8":
        return torch.int8
    if kv_dtype == "int4":
        return torch.uint8
    raise UserInputError(f"unknown KV-cache dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")


def kv_head_width(kv_dtype: str, head_dim: int) -> int:
    """Elements of one head's row in the cache: head_dim, or the bytes of its q4_0 blocks (int4)."""
    return kv_int4_head_bytes(head_dim) if kv_dtype == "int4" else head_dim


def kv_block_bytes(block_size: int, num_kv_heads: int, head_dim: int, kv_dtype: str,
                   model_dtype: torch.dtype) -> int:
    """Bytes of one block of one layer (K and V, plus the int8 scales)."""
    elem = torch.empty(0, dtype=kv_cache_torch_dtype(kv_dtype, model_dtype)).element_size()
    n = 2 * block_size * num_kv_heads * kv_head_width(kv_dtype, head_dim) * elem
    if kv_dtype == "int8":
        n += 2 * block_size * num_kv_heads * 4
    return n


def _check_int8_scales(kv_dtype: str, k_scale_cache, v_scale_cache) -> None:
    if kv_dtype == "int8" and (k_scale_cache is None or v_scale_cache is None):
        raise UserInputError("the int8 KV cache needs k_scale_cache and v_scale_cache")


def quantize_q4(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., D] -> their q4_0 blocks as uint8 [..., D / 32 * 18], as llama.cpp's
    quantize_row_q4_0_ref computes them (float32 arithmetic, codes truncated from x / d + 8.5)."""
    xf = x.float().reshape(*x.shape[:-1], -1, Q4_VALUES)
    top = xf.gather(-1, xf.abs().argmax(-1, keepdim=True))       # the first value of largest magnitude
    d = top / -8.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.trunc(xf * inv + 8.5).clamp_(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    out = torch.cat((d.to(torch.float16).view(torch.uint8), packed), -1)
    return out.reshape(*x.shape[:-1], -1)


def dequantize_q4(blocks: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """q4_0 rows uint8 [..., n * 18] -> values [..., n * 32]: (q - 8) * d."""
    b = blocks.reshape(*blocks.shape[:-1], -1, Q4_BYTES)
    d = b[..., :2].contiguous().view(torch.float16).to(out_dtype)
    qs = b[..., 2:]
    q = torch.cat((qs & 0xF, qs >> 4), -1).to(out_dtype) - 8
    return (q * d).reshape(*blocks.shape[:-1], -1)


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, kv_dtype: str, scale: float):
    """Quantize new K or V rows [N, Hkv, D] for the cache. Returns (stored, per-row scales or None)."""
    if kv_dtype == "int4":
        return quantize_q4(x), None
    if kv_dtype == "int8":
        xf = x.float()
        s = xf.abs().amax(-1) / INT8_MAX  # [N, Hkv]
        codes = torch.round(xf / s.clamp_min(1e-30)[..., None]).clamp_(-INT8_MAX, INT8_MAX)
        return codes.to(torch.int8), s
    if cache_dtype in FP8_MAX:
        m = FP8_MAX[cache_dtype]
        return (x.float() / float(scale)).clamp_(-m, m).to(cache_dtype), None
    return x.to(cache_dtype), None


def dequantize_kv(stored: torch.Tensor, kv_dtype: str, scale: float, row_scales, out_dtype) -> torch.Tensor:
    """Inverse of `quantize_kv` for gathered rows [..., Hkv, D] (row_scales [..., Hkv] for int8)."""
    if kv_dtype == "int4":
        return dequantize_q4(stored, out_dtype)
    if kv_dtype == "int8":
        return stored.to(out_dtype) * row_scales.to(out_dtype)[..., None]
    if stored.dtype in FP8_MAX:
        return stored.to(out_dtype) * float(scale)
    return stored.to(out_dtype)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, kv_dtype: str, k_scale: float, v_scale: float,
             k_scale_cache: torch.Tensor | None = None, v_scale_cache: torch.Tensor | None = None,
             kept: tuple | None = None) -> None:
    """Store k, v [N, Hkv, D] at `slot_mapping` [N] (negative slots are skipped, as padding).
    kept: `real_slots(slot_mapping)`, computed once per step by a caller that writes every layer
    with the same mapping (the runner's attention context)."""
    _check_int8_scales(kv_dtype, k_scale_cache, v_scale_cache)
    slots, keep = kept if kept is not None else real_slots(slot_mapping)
    if keep is not None:
        k, v = k[keep], v[keep]
    if slots.numel() == 0:
        return
    nb, bs, hkv, d = key_cache.shape
    for cache, x, scale, scache in ((key_cache, k, k_scale, k_scale_cache), (value_cache, v, v_scale, v_scale_cache)):
        stored, row_scales = quantize_kv(x, cache.dtype, kv_dtype, scale)
        # index_copy_ on rows (fp8 as bytes: the CPU has no float8 index_copy_); indexed assignment
        # (index_put_) is a thousand times slower on the CPU
        _bytes(cache).view(nb * bs, hkv * d).index_copy_(0, slots, _bytes(stored).reshape(-1, hkv * d))
        if row_scales is not None:
            scache.view(nb * bs, hkv).index_copy_(0, slots, row_scales.to(scache.dtype))


def real_slots(slot_mapping: torch.Tensor):
    """(slots as int64 without the padding ones, the mask of kept rows or None)."""
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        return slots[keep], keep
    return slots, None


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype in FP8_MAX else x


def _gather(cache: torch.Tensor, blocks: torch.Tensor, kv_dtype: str, scale: float,
            scale_cache: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Dequantized rows of the given blocks: blocks [S, nb] -> [S, nb * block_size, Hkv, D]."""
    flat = blocks.reshape(-1)
    g = _bytes(cache).index_select(0, flat).view(cache.dtype)
    rs = scale_cache.index_select(0, flat) if kv_dtype == "int8" else None
    x = dequantize_kv(g, kv_dtype, scale, rs, dtype)
    return x.view(blocks.shape[0], -1, cache.shape[2], x.shape[-1])


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, window: int | None, kv_dtype: str, k_scale: float, v_scale: float,
                    k_scale_cache: torch.Tensor | None = None,
                    v_scale_cache: torch.Tensor | None = None, plan: tuple | None = None,
                    pages: tuple | None = None) -> torch.Tensor:
    """Varlen causal attention over the paged cache. q [Nq, Hq, D] -> [Nq, Hq, D].

    Sequence s owns queries q[query_start_loc[s]:query_start_loc[s+1]], the last positions of its
    context of seq_lens[s] tokens (already in the cache). A query at position i sees keys j with
    j <= i and i - j < window. Decode rows (one query) are batched in buckets of similar length;
    longer ones go one by one. Slots past a sequence's end must hold finite values (caches are
    zero-initialized): they are masked out of the softmax, but a NaN there would still reach p @ V.
    plan: `decode_plan(block_tables, seq_lens, query_start_loc, block_size, window, device)`, built
    once per step by a caller whose layers share the metadata (the runner's attention context).
    pages: kivi2's (key_pages, value_pages, quant_blocks [S]); the caches are then its residual.
    """
    _check_int8_scales(kv_dtype, k_scale_cache, v_scale_cache)
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    cdt = _compute_dtype(q)
    bs = key_cache.shape[1]
    kv = (key_cache, value_cache, kv_dtype, k_scale, v_scale, k_scale_cache, v_scale_cache, pages)
    buckets, longer = plan if plan is not None else decode_plan(block_tables, seq_lens, query_start_loc, bs,
                                                                 window, q.device)
    for rows, seqs, blocks, mask in buckets:
        _decode_batch(q, out, kv, rows, seqs, blocks, mask, scale, cdt)
    for s, start, n, length in longer:
        _one_sequence(q, out, kv, s, block_tables[s], start, n, length, bs, scale, window, cdt)
    return out


def decode_plan(block_tables, seq_lens, query_start_loc, bs, window, dev):
    """Decode rows (one query) in buckets of lengths within a factor of two of the bucket's longest
    (little padding): (query rows, sequences, block ids [S, nb], mask [S, nb * bs]) each; longer queries one by
    one: (sequence, first query row, queries, length)."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = sorted((s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1), key=lambda s: -lens[s])
    buckets = []
    while decode:
        n = 1
        while n < len(decode) and 2 * lens[decode[n]] > lens[decode[0]]:
            n += 1
        seqs, decode = decode[:n], decode[n:]
        nblocks = -(-max(lens[s] for s in seqs) // bs)
        blocks = block_tables[torch.tensor(seqs, device=dev), :nblocks].long().clamp_min(0)  # padding entries
        d = (torch.tensor([lens[s] for s in seqs], device=dev) - 1)[:, None] - torch.arange(nblocks * bs, device=dev)
        mask = d >= 0
        if window is not None:
            mask &= d < window
        buckets.append((torch.tensor([starts[s] for s in seqs], device=dev), torch.tensor(seqs, device=dev), blocks,
                        mask[:, None, None, :]))
    longer = [(s, starts[s], starts[s + 1] - starts[s], lens[s]) for s in range(len(lens)) if starts[s + 1] - starts[s] > 1]
    return buckets, longer


def _keys_values(kv, seqs, blocks, cdt):
    key_cache, value_cache, kv_dtype, k_scale, v_scale, k_sc, v_sc, pages = kv
    if pages is not None:
        key_pages, value_pages, quant_blocks = pages
        return kivi.gather_rows(key_cache, value_cache, key_pages, value_pages, blocks, quant_blocks[seqs], cdt)
    k = _gather(key_cache, blocks, kv_dtype, k_scale, k_sc, cdt)
    v = _gather(value_cache, blocks, kv_dtype, v_scale, v_sc, cdt)
    return k, v


def _one_sequence(q, out, kv, s, table, start, n, length, bs, scale, window, cdt):
    nblocks = -(-length // bs)
    k, v = _keys_values(kv, torch.tensor([s], device=q.device), table[None, :nblocks].long(), cdt)
    k, v = k[0, :length].transpose(0, 1), v[0, :length].transpose(0, 1)  # [Hkv, L, D]
    qs = q[start:start + n].to(cdt).transpose(0, 1)  # [Hq, n, D]
    gqa = qs.shape[0] != k.shape[0]
    if n == length and (window is None or window >= length):
        o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        d = torch.arange(length - n, length, device=q.device)[:, None] - torch.arange(length, device=q.device)
        mask = d >= 0
        if window is not None:
            mask &= d < window
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    out[start:start + n] = o.transpose(0, 1).to(out.dtype)


def _decode_batch(q, out, kv, rows, seqs, blocks, mask, scale, cdt):
    k, v = _keys_values(kv, seqs, blocks, cdt)  # [S, L, Hkv, D]
    ns, hkv = rows.shape[0], k.shape[2]
    qs = q[rows].to(cdt).view(ns, hkv, -1, q.shape[-1])  # the head group as query rows of its kv head
    o = F.scaled_dot_product_attention(qs, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    out.index_copy_(0, rows, o.reshape(ns, -1, q.shape[-1]).to(out.dtype))  # (index_put_ is slow on the CPU)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the model computes it (float32 statistics, result cast back, times weight)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate-half RoPE on q [N, Hq, D] and k [N, Hkv, D] with cos/sin [N, D]; returns (q, k)."""
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)

    def rot(x):
        h = x.shape[-1] // 2
        return x * c + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * s

    return rot(q), rot(k)
