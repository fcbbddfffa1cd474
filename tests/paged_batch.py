"""Random paged-attention batches for the kernel tests, scripts/gpu_check.py and scripts/bench_kernels.py
(a test tool, not part of the runtime package; scripts/benchlib.py loads it from this file).

`make_batch` builds dense K/V per sequence, writes them into a paged cache whose blocks are a random
permutation of the pool (with garbage in every unwritten slot, so a kernel that reads past a
sequence's end shows it), and returns what `paged_attention` takes plus the dense K/V.
`dense_attention` is the independent float64 oracle: explicit scores, mask and softmax.
`make_kivi_batch` builds kivi2 caches (2-bit pages for each sequence's first quant_blocks blocks, a
residual after them) and `kivi_oracle` attends over their dequantized rows in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.cache.kivi import key_page_bytes, value_page_bytes
from llmopt.kernels.kivi import dequantize_keys, dequantize_values, quantize_keys, quantize_values
from llmopt.kernels.reference import kv_cache_torch_dtype, kv_head_width, write_kv


@dataclass
class PagedBatch:
    q: torch.Tensor                 # [Nq, Hq, D]
    k_new: torch.Tensor             # [Ntok, Hkv, D] every context token, in sequence order
    v_new: torch.Tensor
    slot_mapping: torch.Tensor      # [Ntok] int64
    key_cache: torch.Tensor         # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor
    k_scale_cache: torch.Tensor | None
    v_scale_cache: torch.Tensor | None
    block_tables: torch.Tensor      # [S, max_blocks] int32, padded with -1
    seq_lens: torch.Tensor          # [S] int32
    query_start_loc: torch.Tensor   # [S + 1] int32
    specs: list                     # [(context_len, query_len)]
    kv_dtype: str
    k_scale: float
    v_scale: float


def empty_cache(num_blocks: int, block_size: int, hkv: int, d: int, kv_dtype: str, dtype, device,
                garbage: str = "nan"):
    """Cache tensors whose every element is garbage: "nan" (0x7F bytes are NaN in both fp8 formats;
    the Triton kernels must never load it) or "big" (large finite values, which the reference
    requires past a sequence's end and must still mask out)."""
    cdt = kv_cache_torch_dtype(kv_dtype, dtype)
    shape = (num_blocks, block_size, hkv, kv_head_width(kv_dtype, d))
    nan = garbage == "nan"
    caches = []
    for _ in range(2):
        c = torch.empty(shape, dtype=cdt, device=device)
        if cdt == torch.int8:
            c.copy_(torch.randint(-127, 128, shape, dtype=torch.int8, device=device))
        elif c.element_size() == 1:
            c.view(torch.uint8).fill_(0x7F if nan else 0x7B)  # e4m3 0x7B = 240, e5m2 0x7B = 57344
        else:
            c.fill_(float("nan") if nan else 1e4)
        caches.append(c)
    scales = [None, None]
    if kv_dtype == "int8":
        scales = [torch.full(shape[:3], float("nan") if nan else 1e3, device=device) for _ in range(2)]
    return caches[0], caches[1], scales[0], scales[1]


def make_batch(specs, hq: int, hkv: int, d: int, block_size: int, kv_dtype: str = "auto",
               dtype=torch.float32, device="cpu", seed: int = 0, k_scale: float = 1.0, v_scale: float = 1.0,
               extra_blocks: int = 3, garbage: str = "nan") -> PagedBatch:
    """specs: [(context_len, query_len)] per sequence, query_len <= context_len. The same seed gives
    the same written data whatever the garbage (see `empty_cache`)."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-c // block_size) for c, _ in specs]
    total = sum(nblocks) + extra_blocks
    perm = torch.randperm(total, generator=g)
    tables = torch.full((len(specs), max(nblocks) + 1), -1, dtype=torch.int32)
    slots, ks, vs, qs = [], [], [], []
    used = 0
    for s, (ctx, n) in enumerate(specs):
        blocks = perm[used:used + nblocks[s]]
        used += nblocks[s]
        tables[s, :nblocks[s]] = blocks.to(torch.int32)
        pos = torch.arange(ctx)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        ks.append(torch.randn(ctx, hkv, d, generator=g))
        vs.append(torch.randn(ctx, hkv, d, generator=g))
        qs.append(torch.randn(n, hq, d, generator=g))
    kc, vc, ksc, vsc = empty_cache(total, block_size, hkv, d, kv_dtype, dtype, device, garbage)
    k_new = torch.cat(ks).to(device=device, dtype=dtype)
    v_new = torch.cat(vs).to(device=device, dtype=dtype)
    slot_mapping = torch.cat(slots).to(device)
    write_kv(kc, vc, k_new, v_new, slot_mapping, kv_dtype, k_scale, v_scale, ksc, vsc)
    qsl = torch.zeros(len(specs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([n for _, n in specs]), 0)
    return PagedBatch(
        q=torch.cat(qs).to(device=device, dtype=dtype), k_new=k_new, v_new=v_new, slot_mapping=slot_mapping,
        key_cache=kc, value_cache=vc, k_scale_cache=ksc, v_scale_cache=vsc, block_tables=tables.to(device),
        seq_lens=torch.tensor([c for c, _ in specs], dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device), specs=list(specs), kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)


def run_paged(fn, b: PagedBatch, scale: float, window):
    """Call a `paged_attention` implementation on a batch."""
    return fn(b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc, scale, window,
              b.kv_dtype, b.k_scale, b.v_scale, b.k_scale_cache, b.v_scale_cache)


def dense_attention(q, k_seqs, v_seqs, specs, scale: float, window) -> torch.Tensor:
    """float64 oracle: per sequence, explicit causal (+window) GQA softmax attention of its last
    query_len positions over its dense K/V [ctx, Hkv, D]."""
    outs = []
    start = 0
    for (ctx, n), k, v in zip(specs, k_seqs, v_seqs):
        qs = q[start:start + n].double()
        start += n
        group = qs.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)  # head h reads kv head h // group
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("ihd,jhd->hij", qs, kk) * scale
        i = torch.arange(ctx - n, ctx)[:, None]
        j = torch.arange(ctx)[None, :]
        allowed = (j <= i) if window is None else (j <= i) & (i - j < window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("hij,jhd->ihd", p, vv))
    return torch.cat(outs)


@dataclass
class KiviBatch:
    q: torch.Tensor
    key_cache: torch.Tensor       # residual [num_residual_blocks, G, Hkv, D]
    value_cache: torch.Tensor
    key_pages: torch.Tensor       # uint8 [num_pages, Hkv, key_page_bytes]
    value_pages: torch.Tensor
    quant_blocks: torch.Tensor    # int32 [S]
    block_tables: torch.Tensor    # int32 [S, max_blocks + 1], -1 padded
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    specs: list
    group: int


def make_kivi_batch(specs, hq, hkv, d, g, res_dtype=torch.float32, q_dtype=torch.float32, seed=0, garbage="nan",
                    device="cpu") -> KiviBatch:
    """Random keys (channel offsets, as real keys have) and values; block b of sequence s quantized
    into a page when b < quant_blocks[s], else written to a residual block. The same seed gives the
    same data whatever the garbage ("nan" for Triton, "big" finite values for the reference)."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = [-(-ctx // g) for ctx, _, _ in specs]
    assert all(qb <= ctx // g for ctx, _, qb in specs)
    n_pages = sum(qb for _, _, qb in specs) + 2
    n_res = sum(nb - qb for nb, (_, _, qb) in zip(nblocks, specs)) + 2
    page_ids, res_ids = torch.randperm(n_pages, generator=gen).tolist(), torch.randperm(n_res, generator=gen).tolist()
    key_pages = torch.full((n_pages, hkv, key_page_bytes(g, d)), 0x7F, dtype=torch.uint8)
    value_pages = torch.full((n_pages, hkv, value_page_bytes(g, d)), 0x7F, dtype=torch.uint8)
    fill = float("nan") if garbage == "nan" else 1e4
    key_cache = torch.full((n_res, g, hkv, d), fill, dtype=res_dtype)
    value_cache = torch.full((n_res, g, hkv, d), fill, dtype=res_dtype)
    tables = torch.full((len(specs), max(nblocks) + 1), -1, dtype=torch.int32)
    qs = []
    for s, ((ctx, n, qb), nb) in enumerate(zip(specs, nblocks)):
        k = torch.randn(nb * g, hkv, d, generator=gen) + 2 * torch.randn(hkv, d, generator=gen)
        v = torch.randn(nb * g, hkv, d, generator=gen)
        qs.append(torch.randn(n, hq, d, generator=gen))
        for b in range(nb):
            rows = slice(b * g, min((b + 1) * g, ctx))
            if b < qb:
                i = page_ids.pop()
                key_pages[i] = quantize_keys(k[None, rows])[0]
                value_pages[i] = quantize_values(v[None, rows])[0]
            else:
                i = res_ids.pop()
                key_cache[i, :rows.stop - rows.start] = k[rows].to(res_dtype)
                value_cache[i, :rows.stop - rows.start] = v[rows].to(res_dtype)
            tables[s, b] = i
    qsl = torch.zeros(len(specs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([n for _, n, _ in specs]), 0)
    return KiviBatch(*(x.to(device) for x in (
        torch.cat(qs).to(q_dtype), key_cache, value_cache, key_pages, value_pages,
        torch.tensor([qb for _, _, qb in specs], dtype=torch.int32), tables,
        torch.tensor([ctx for ctx, _, _ in specs], dtype=torch.int32), qsl)), list(specs), g)


def run_kivi(fn, b: KiviBatch, scale: float, window=None, quant_blocks=None, **knobs):
    """fn (a paged_attention) over the batch, its pages passed as `pages`."""
    pages = (b.key_pages, b.value_pages, b.quant_blocks if quant_blocks is None else quant_blocks)
    return fn(b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc, scale, window,
              "kivi2", 1.0, 1.0, None, None, pages=pages, **knobs)


def kivi_rows(b: KiviBatch, s: int):
    """Sequence s's keys and values [ctx, Hkv, D] in float64: dequantized pages, then residual rows."""
    ctx, _, qb = b.specs[s]
    g, d = b.group, b.key_cache.shape[-1]
    ks, vs = [], []
    for blk in range(-(-ctx // g)):
        i = int(b.block_tables[s, blk])
        if blk < qb:
            ks.append(dequantize_keys(b.key_pages[i:i + 1], g, d, torch.float64)[0])
            vs.append(dequantize_values(b.value_pages[i:i + 1], g, d, torch.float64)[0])
        else:
            ks.append(b.key_cache[i].double())
            vs.append(b.value_cache[i].double())
    return torch.cat(ks)[:ctx], torch.cat(vs)[:ctx]


def kivi_oracle(b: KiviBatch, scale: float, window=None) -> torch.Tensor:
    """float64 causal (+window) GQA softmax attention of each sequence's queries over its rows."""
    outs = []
    start = 0
    for s, (ctx, n, _) in enumerate(b.specs):
        k, v = kivi_rows(b, s)
        q = b.q[start:start + n].double()
        start += n
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)   # head h reads kv head h // group
        scores = torch.einsum("ihd,jhd->hij", q, k) * scale
        i, j = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :]
        allowed = (j <= i) if window is None else (j <= i) & (i - j < window)
        p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
        outs.append(torch.einsum("hij,jhd->ihd", p, v))
    return torch.cat(outs)
