"""The block pool: every KV-cache block, its reference count, the free queue and the prefix cache.

A block holds `block_size` token slots in every layer's K/V tensors. Blocks in use have a reference
count > 0 (several requests may share a cached prefix block). Free blocks sit in an LRU queue:
a freed block that still holds a full, hashed block of tokens stays findable in the prefix cache
until the pool needs a fresh block and evicts it from the front of the queue.

A full block is identified by a chained hash: `hash(parent block hash, its token ids)`, so equal
hashes mean equal whole prefixes. SHA-256 makes an accidental collision practically impossible.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from llmopt.errors import LLMOptError

BlockHash = bytes
NONE_HASH: BlockHash = b""


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: (parent hash, token ids)."""
    h = hashlib.sha256(parent or NONE_HASH)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def hash_request_blocks(token_ids: Sequence[int], block_size: int, start: int = 0,
                        parent: BlockHash | None = None) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block index `start` (parent = hash of block start-1)."""
    out: list[BlockHash] = []
    for b in range(start, len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[b * block_size:(b + 1) * block_size])
        out.append(parent)
    return out


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set while the block is registered in the prefix cache


@dataclass
class PrefixCacheStats:
    queries: int = 0   # tokens looked up
    hits: int = 0      # tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Blocks, ref counts, an LRU free queue, and the hash -> block map of the prefix cache."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True,
                 on_evict: Callable[[KVBlock, BlockHash], None] | None = None) -> None:
        if num_blocks < 1:
            raise LLMOptError("the KV cache has no blocks: give it more memory (--kv-cache-memory / "
                              "--gpu-memory-utilization) or use a smaller --block-size")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order = eviction order: front is the least recently freed block.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self.stats = PrefixCacheStats()
        self.on_evict = on_evict   # told of each cached block handed out again (the offload tier saves it)

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    # -- allocation ----------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks from the front of the free queue (evicting their cached contents)."""
        if n > len(self._free):
            raise LLMOptError(f"asked for {n} KV blocks but only {len(self._free)} are free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None and self.on_evict is not None:
                self.on_evict(block, block.block_hash)
            self.uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (removing free ones from the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; pass them in eviction order (the tail of a request first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise LLMOptError(f"KV block {block.block_id} freed more times than it was allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # Holds nothing reusable: put it first in line to be handed out again.
                    self._free[block.block_id] = block
                    self._free.move_to_end(block.block_id, last=False)
                else:
                    self._free[block.block_id] = block

    # -- prefix cache ----------------------------------------------------------------------------
    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a block that now holds a full block of tokens whose chained hash is block_hash."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:  # the same tokens are already cached in another block
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def uncache(self, block: KVBlock) -> None:
        """Remove a block from the prefix cache (its contents are not reusable)."""
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (only when no block is in use); returns whether it did."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            self.uncache(block)
        return True

    def check_invariants(self) -> None:
        """Raise if the free queue, ref counts and cache map disagree (used by tests)."""
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise LLMOptError(f"block {block.block_id} has a negative ref count")
            if (block.ref_cnt == 0) != (block.block_id in self._free):
                raise LLMOptError(f"block {block.block_id}: ref count {block.ref_cnt} but free={block.block_id in self._free}")
        for h, block in self._cached.items():
            if block.block_hash != h:
                raise LLMOptError(f"block {block.block_id} is cached under a hash it does not carry")
