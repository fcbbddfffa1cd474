"""KV-cache groups (vLLM's hybrid allocator, vllm/v1/core/kv_cache_utils.py): layers of different
attention types (full, each sliding window) keep separate block tables, so a windowed layer frees
the blocks its window has left while a full layer keeps them all.

Every group has the same number of layers (`group_size`): layer j of each group shares the same K/V
tensor (a block id belongs to one group at a time, so the groups never write each other's blocks),
and one block id costs `group_size` layers' bytes. The split, as vLLM's: the layers of each type in
model order; group_size is the largest type count when it is below 1.5x the smallest, else the
smallest; a type of n layers becomes cdiv(n, group_size) groups, layers[i::groups] each (the last
ones may be short: padding slots). kv-estimate plans the same split (llmopt/estimate/plan.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Hashable, TypeVar

from llmopt.cache.block_pool import BlockHash, KVBlock

T = TypeVar("T")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_by_type(by_type: dict[Hashable, list[T]]) -> tuple[int, list[tuple[Hashable, list[T]]]]:
    """(group_size, [(type, members)]) for layers listed per type in model order."""
    counts = [len(v) for v in by_type.values()]
    size = max(counts) if max(counts) < min(counts) * 1.5 else min(counts)
    groups = []
    for key, members in by_type.items():
        n = cdiv(len(members), size)
        groups += [(key, members[i::n]) for i in range(n)]
    return size, groups


@dataclass(frozen=True)
class KVGroupSpec:
    window: int | None          # every layer's sliding window (None: full attention)
    layers: tuple[int, ...]     # model layer indices, in the order of the shared tensors


def kv_cache_groups(layer_windows: list[int | None], hybrid: bool = True) -> tuple[int, list[KVGroupSpec]]:
    """(group_size, groups) of a model's layers. One group when every layer has the same window,
    or when `hybrid` is off (vLLM's --disable-hybrid-kv-cache-manager: every layer keeps every
    block, windows or not)."""
    windows = list(layer_windows)
    if not hybrid or len(set(windows)) <= 1:
        return len(windows), [KVGroupSpec(windows[0] if hybrid and windows else None, tuple(range(len(windows))))]
    by_type: dict[Hashable, list[int]] = {}
    for i, w in enumerate(windows):
        by_type.setdefault(w, []).append(i)
    size, groups = split_by_type(by_type)
    specs = [KVGroupSpec(w, tuple(members)) for w, members in groups]
    return size, sorted(specs, key=lambda g: g.window is not None)   # a full group first: drafters read its table


class GroupTables:
    """One group's block tables: each request's blocks (None where a freed, out-of-window block
    was), how many leading ones it offered to the prefix cache, and its window. The prefix cache
    keys a block by its chained hash, made distinct per group (`key`): the same tokens' blocks of
    two groups hold different layers."""

    def __init__(self, index: int, window: int | None, block_size: int) -> None:
        self.index, self.window, self.block_size = index, window, block_size
        self.blocks: dict[str, list[KVBlock | None]] = {}
        self.num_registered: dict[str, int] = {}

    def key(self, block_hash: BlockHash) -> BlockHash:
        return block_hash if self.index == 0 else hashlib.sha256(block_hash + bytes([self.index])).digest()

    def skipped(self, num_computed: int) -> int:
        """Leading blocks no token from position num_computed on attends to (0 without a window)."""
        return max(0, num_computed - self.window + 1) // self.block_size if self.window else 0

    def needed(self) -> int:
        """Blocks before a position its window reaches back into (all of them without a window)."""
        return cdiv(self.window - 1, self.block_size) if self.window else -1

    def longest_hit(self, cached: list[bool], k: int) -> int:
        """The most leading blocks (at most k) this group can take as a prefix hit, `cached[i]`
        saying whether block i is found: a full group needs every one; a windowed group only the
        ones its window reaches from the hit's end (vLLM's find_longest_cache_hit)."""
        need = self.needed()
        if need < 0:
            return next((i for i in range(k) if not cached[i]), k)
        while k > 0 and not all(cached[max(0, k - need):k]):
            k -= 1
        return k

    def held(self, request_id: str) -> int:
        return sum(b is not None for b in self.blocks.get(request_id, ()))
