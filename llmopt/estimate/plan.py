"""Paged KV-cache accounting, as vLLM v1 (vllm/v1/core/kv_cache_utils.py, kv_cache_interface.py)
and the llmopt engine do it: group the layers, size one block, divide the memory into blocks, and
count the blocks a request holds.

- One attention type (every layer the same shape): one group of all layers; vLLM's
  `get_num_blocks`: num_blocks = available // page_size // num_layers (the engine:
  kv_cache_memory // (num_layers * per-layer block bytes) — the same number).
- Same type, different page sizes (UniformTypeKVCacheSpecs): one group, a block costs the sum of
  the layers' pages.
- Mixed local/global layers (Gemma-2/3, hybrid allocator): page sizes unified, layers split by type
  into groups of `group_size` layers (the smallest type count, or the largest when it is below 1.5x
  the smallest; `layers[i::num_groups]`, padded); num_blocks = available // page_size // group_size,
  every group drawing block ids from that one pool.
- Blocks a request holds at length L (max_memory_usage_bytes / page_size): full attention
  cdiv(L, block_size); sliding window cdiv(min(window - 1 + max_num_batched_tokens, L), block_size) + 1
  (the +1: the window need not start at a block boundary).
- Maximum concurrency (get_max_concurrency_for_kv_cache_config): num_blocks / blocks per request at
  max_model_len. Tokens (the "GPU KV cache size" log line): num_blocks // num_groups * block_size.
- Longest context (estimate_max_model_len): the largest L with block_bytes * blocks(L) <= available.
- KIVI 2-bit (llmopt/cache/kivi.py): a block is one group; the budget is split between the quantized
  blocks and the full-precision residual as the engine splits it (`kivi_pools`), and a request holds
  `request_blocks(L)` of each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmopt.cache.groups import split_by_type
from llmopt.cache.kivi import KiviConfig, KiviPools, kivi_pools, request_blocks as kivi_request_blocks
from llmopt.cache.kv_manager import request_blocks
from llmopt.errors import UserInputError
from llmopt.estimate.kv import LayerKV


@dataclass
class KVGroup:
    kind: str                   # full | sliding | mla
    window: int | None
    layers: list[int]           # layer indices (padding slots are not listed)
    block_size: int             # tokens per block in this group
    page_bytes: int             # bytes of one block of one layer (uniform-type: of all layers)
    kivi: KiviConfig | None = None
    residual_token_bytes: int = 0   # KIVI: per layer per token in the full-precision residual
    page_layers: int = 1        # layers whose blocks page_bytes covers (uniform-type: all of them)

    def blocks(self, length: int, max_num_batched_tokens: int) -> int:
        """Blocks a request of `length` tokens holds in this group: the engine's own count (KIVI: its
        quantized ones; `residual_blocks` the others)."""
        if self.kivi is not None:
            return kivi_request_blocks(length, self.block_size, self.kivi.residual_length)[0]
        window = self.window if self.kind == "sliding" else None
        return request_blocks(length, self.block_size, window, max_num_batched_tokens)

    def residual_blocks(self, length: int) -> int:
        if self.kivi is None:
            return 0
        return kivi_request_blocks(length, self.block_size, self.kivi.residual_length)[1]


@dataclass
class KVLayout:
    mode: str                   # uniform | uniform-type | hybrid
    groups: list[KVGroup]
    group_size: int             # layers sharing one block id per group (hybrid pools)
    block_bytes: int            # bytes one block id costs across every layer that uses it
    padding_layers: int = 0

    def blocks_per_request(self, length: int, max_num_batched_tokens: int) -> int:
        return sum(g.blocks(length, max_num_batched_tokens) for g in self.groups)

    @property
    def kivi(self) -> KiviConfig | None:
        return self.groups[0].kivi

    @property
    def residual_block_bytes(self) -> int:
        """KIVI: one full-precision block of every layer."""
        g = self.groups[0]
        return g.residual_token_bytes * g.block_size * len(g.layers)

    def residual_blocks(self, length: int) -> int:
        return sum(g.residual_blocks(length) for g in self.groups)

    def num_blocks(self, available_bytes: int) -> int:
        return max(0, available_bytes // self.block_bytes)

    def kivi_pools(self, available_bytes: int, max_model_len: int, max_num_seqs: int,
                   max_num_batched_tokens: int) -> KiviPools:
        """The engine's split of a KIVI budget into quantized and residual blocks."""
        k = self.kivi
        return kivi_pools(available_bytes, self.block_bytes, self.residual_block_bytes, max_model_len, max_num_seqs,
                          max_num_batched_tokens, k.group_size, k.residual_length)

    def tokens(self, num_blocks: int) -> int:
        return num_blocks // len(self.groups) * min(g.block_size for g in self.groups)

    def bytes_for(self, length: int, max_num_batched_tokens: int) -> int:
        return (self.block_bytes * self.blocks_per_request(length, max_num_batched_tokens)
                + self.residual_block_bytes * self.residual_blocks(length))

    def longest_context(self, available_bytes: int, max_num_batched_tokens: int, upper: int) -> int:
        """Largest length whose blocks fit (0: not even one token), searched up to `upper`."""
        return largest_length(lambda n: self.bytes_for(n, max_num_batched_tokens) <= available_bytes, upper)


def largest_length(fits, upper: int) -> int:
    """The largest length up to `upper` that `fits` (monotone: shorter ones fit too), 0 when none does."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _group(layers: list[LayerKV], kind: str, window, block_size: int, page: int, page_layers: int = 1) -> KVGroup:
    first = layers[0]
    return KVGroup(kind, window, [x.index for x in layers], block_size, page, first.kivi, first.residual_token_bytes,
                   page_layers)


def build_layout(layers: list[LayerKV], block_size: int, hybrid: bool = True) -> KVLayout:
    if block_size < 1:
        raise UserInputError(f"--block-size must be positive, got {block_size}")
    if layers and layers[0].kivi is not None:   # a block is one KIVI group, as the engine sets it
        block_size = layers[0].kivi.group_size
    if not layers:
        raise UserInputError("the model has no attention layers")
    if not hybrid:      # vLLM --disable-hybrid-kv-cache-manager: windows computed, but full blocks held
        layers = [replace(x, kind="full", window=None) if x.kind == "sliding" else x for x in layers]
    pages = [x.page_bytes(block_size) for x in layers]
    types = {(x.kind, x.window) for x in layers}
    if len({(x.kind, x.window, p) for x, p in zip(layers, pages)}) == 1:
        g = _group(layers, layers[0].kind, layers[0].window, block_size, pages[0])
        return KVLayout("uniform", [g], len(layers), pages[0] * len(layers))
    if len(types) == 1:
        g = _group(layers, layers[0].kind, layers[0].window, block_size, sum(pages), len(layers))
        return KVLayout("uniform-type", [g], len(layers), sum(pages))
    top = max(pages)
    by_type: dict[tuple, list[LayerKV]] = {}
    for x, p in zip(layers, pages):
        if top % p:
            raise UserInputError(f"layer page sizes {sorted(set(pages))} cannot be unified by scaling the block size")
        by_type.setdefault((x.kind, x.window, block_size * (top // p)), []).append(x)
    size, split = split_by_type(by_type)   # the engine's split (llmopt/cache/groups.py)
    groups = [_group(members, kind, window, bs, top) for (kind, window, bs), members in split]
    padding = size * len(groups) - len(layers)
    return KVLayout("hybrid", groups, size, top * size, padding)


@dataclass
class GridCell:
    batch_size: int
    seq_len: int
    blocks: int                 # blocks the batch holds
    kv_bytes: int               # per rank
    fits: bool | None           # None when no memory budget was given
    kv_fraction: float | None   # share of the KV cache the batch uses


def grid(layout: KVLayout, batch_sizes: list[int], seq_lens: list[int], max_num_batched_tokens: int,
         num_blocks: int | None, residual_blocks: int | None = None) -> list[GridCell]:
    """residual_blocks: KIVI's full-precision pool, which the batch's residual must fit too."""
    out = []
    for s in seq_lens:
        per = layout.blocks_per_request(s, max_num_batched_tokens)
        res = layout.residual_blocks(s)
        for b in batch_sizes:
            blocks = b * per
            fits = None if num_blocks is None else blocks <= num_blocks
            if fits and residual_blocks is not None:
                fits = b * res <= residual_blocks
            out.append(GridCell(b, s, blocks, layout.bytes_for(s, max_num_batched_tokens) * b, fits,
                                None if not num_blocks else blocks / num_blocks))
    return out
