"""KIVI 2-bit pages (the rules: llmopt/cache/kivi.py): the reference quantizer, dequantizer and the
rows paged attention reads.

A kivi2 cache is, per layer, the residual (`key_cache`/`value_cache`: full precision, [num_residual_blocks,
G, Hkv, D], written like a float cache) and the quantized pages (`key_pages` uint8 [num_blocks, Hkv,
key_page_bytes], `value_pages` uint8 [num_blocks, Hkv, value_page_bytes]). A sequence's block table
holds page ids for its first `quant_blocks[s]` blocks and residual ids after them.

Page of one block's keys of one KV head (per channel c over the block's G tokens):
  fp16 scale[D], fp16 zero[D], codes [G][D / 4]
Page of its values (per token t, per group j of V = min(G, D) channels):
  fp16 scale[G][D / V], fp16 zero[G][D / V], codes [G][D / 4]
A code q in 0..3 stands for q * scale + zero; zero is the group's minimum and scale (max - min) / 3,
both rounded to fp16 first, and q = round((x - zero) / scale) clamped to 0..3 (0 when scale is 0).
Codes: channel c of token t in byte t * D / 4 + c / 4, bits 2 * (c % 4) and up.
"""

from __future__ import annotations

import torch

from llmopt.cache.kivi import value_group


def pack2(q: torch.Tensor) -> torch.Tensor:
    """Codes 0..3 [..., D] -> uint8 [..., D / 4], channel c in bits 2 * (c % 4) of byte c / 4."""
    q = q.to(torch.uint8).reshape(*q.shape[:-1], -1, 4)
    return q[..., 0] | (q[..., 1] << 2) | (q[..., 2] << 4) | (q[..., 3] << 6)


def unpack2(b: torch.Tensor) -> torch.Tensor:
    """Inverse of pack2: uint8 [..., D / 4] -> codes [..., D] (uint8)."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)
    return ((b[..., None] >> shifts) & 3).reshape(*b.shape[:-1], -1)


def _quantize(x: torch.Tensor, dim: int):
    """x float32 grouped along `dim`: (fp16 scale, fp16 zero, codes) with the group reduced away."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale, zero = ((hi - lo) / 3).half(), lo.half()
    sf, zf = scale.float(), zero.float()
    q = torch.where(sf > 0, torch.round((x - zf) / torch.where(sf > 0, sf, 1.0)), 0.0).clamp_(0, 3)
    return scale.squeeze(dim), zero.squeeze(dim), q


def quantize_keys(x: torch.Tensor) -> torch.Tensor:
    """Full blocks of keys [n, G, Hkv, D] -> their pages uint8 [n, Hkv, key_page_bytes]."""
    n, g, h, d = x.shape
    xf = x.float().permute(0, 2, 1, 3)                       # [n, H, G, D]: per channel over the tokens
    scale, zero, q = _quantize(xf, 2)
    codes = pack2(q).reshape(n, h, -1)
    return torch.cat((scale.view(torch.uint8), zero.view(torch.uint8), codes), -1)


def quantize_values(x: torch.Tensor) -> torch.Tensor:
    """Full blocks of values [n, G, Hkv, D] -> their pages uint8 [n, Hkv, value_page_bytes]."""
    n, g, h, d = x.shape
    v = value_group(g, d)
    xf = x.float().permute(0, 2, 1, 3).reshape(n, h, g, d // v, v)   # per token over groups of channels
    scale, zero, q = _quantize(xf, 4)
    codes = pack2(q.reshape(n, h, g, d)).reshape(n, h, -1)
    return torch.cat((scale.reshape(n, h, -1).view(torch.uint8), zero.reshape(n, h, -1).view(torch.uint8), codes), -1)


def dequantize_keys(pages: torch.Tensor, group_size: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Pages uint8 [n, Hkv, key_page_bytes] -> keys [n, G, Hkv, D]."""
    n, h, _ = pages.shape
    d = head_dim
    scale = pages[..., :2 * d].contiguous().view(torch.float16).to(dtype)          # [n, H, D]
    zero = pages[..., 2 * d:4 * d].contiguous().view(torch.float16).to(dtype)
    q = unpack2(pages[..., 4 * d:].reshape(n, h, group_size, d // 4)).to(dtype)     # [n, H, G, D]
    return (q * scale[:, :, None] + zero[:, :, None]).permute(0, 2, 1, 3)


def dequantize_values(pages: torch.Tensor, group_size: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Pages uint8 [n, Hkv, value_page_bytes] -> values [n, G, Hkv, D]."""
    n, h, _ = pages.shape
    g, d = group_size, head_dim
    v = value_group(g, d)
    m = 2 * g * (d // v)
    scale = pages[..., :m].contiguous().view(torch.float16).to(dtype).reshape(n, h, g, d // v, 1)
    zero = pages[..., m:2 * m].contiguous().view(torch.float16).to(dtype).reshape(n, h, g, d // v, 1)
    q = unpack2(pages[..., 2 * m:].reshape(n, h, g, d // 4)).to(dtype).reshape(n, h, g, d // v, v)
    return (q * scale + zero).reshape(n, h, g, d).permute(0, 2, 1, 3)


@torch.no_grad()
def convert_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, key_pages: torch.Tensor,
                   value_pages: torch.Tensor, residual_ids: torch.Tensor, page_ids: torch.Tensor) -> None:
    """Quantize residual blocks `residual_ids` of one layer into pages `page_ids` (int64 [n] each,
    distinct pages): on the CPU the C++ kernels (llmopt_cpu.kivi_convert: the same bytes, blocks in
    parallel) where they are built, else these PyTorch ops."""
    if residual_ids.numel() == 0:
        return
    if not key_cache.is_cuda:
        from llmopt.kernels import cpu_quant   # deferred: start-up time (its C++ library builds on first use)
        ops = cpu_quant.ops()
        if ops is not None:
            ops.kivi_convert(key_cache, value_cache, key_pages, value_pages, residual_ids, page_ids)
            return
    k, v = key_cache.index_select(0, residual_ids), value_cache.index_select(0, residual_ids)
    key_pages.index_copy_(0, page_ids, quantize_keys(k))
    value_pages.index_copy_(0, page_ids, quantize_values(v))


def gather_rows(key_cache, value_cache, key_pages, value_pages, blocks: torch.Tensor, quant_blocks: torch.Tensor,
                dtype: torch.dtype):
    """Keys and values of the given blocks [S, nb] of sequences holding quant_blocks [S] pages first:
    -> ([S, nb * G, Hkv, D], same). Each id is read from the space its position says (pages before
    quant_blocks[s], residual after); the other gather is masked away."""
    s, nb = blocks.shape
    g, h, d = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    flat = blocks.reshape(-1).long()
    rk = key_cache.index_select(0, flat.clamp(max=key_cache.shape[0] - 1)).to(dtype)
    rv = value_cache.index_select(0, flat.clamp(max=value_cache.shape[0] - 1)).to(dtype)
    page = flat.clamp(max=key_pages.shape[0] - 1)
    qk = dequantize_keys(key_pages.index_select(0, page), g, d, dtype)
    qv = dequantize_values(value_pages.index_select(0, page), g, d, dtype)
    quant = (torch.arange(nb, device=blocks.device)[None] < quant_blocks.to(blocks.device)[:, None]).reshape(-1, 1, 1, 1)
    k = torch.where(quant, qk, rk).reshape(s, nb * g, h, d)
    v = torch.where(quant, qv, rv).reshape(s, nb * g, h, d)
    return k, v
