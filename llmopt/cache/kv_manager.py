"""What the scheduler sees of the KV cache: per-request block lists, prefix-cache lookups, slot
allocation for a step's new tokens, and freeing.

A request only needs `request_id`, `all_token_ids` (prompt + outputs so far),
`num_computed_tokens` (tokens whose K/V are in its blocks) and `cache_salt`: requests with a salt
(the n samples of one prompt) share blocks among themselves even when prefix caching is off, since
their hashes start from the salt and match no one else's. Full blocks are registered in the prefix
cache as soon as slots for them are allocated: within a step every layer writes the K/V of all
tokens before any attention reads them, so a request scheduled later in the same step may already
share them.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from llmopt.cache.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens, hash_request_blocks


class CacheRequest(Protocol):
    request_id: str
    num_computed_tokens: int
    cache_salt: str | None

    @property
    def all_token_ids(self) -> Sequence[int]: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)  # caching decided here, per request
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks of a request offered to the cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def stats(self):
        return self.pool.stats

    def _caches(self, req: CacheRequest) -> bool:
        return self.enable_prefix_caching or bool(getattr(req, "cache_salt", None))

    def block_hashes(self, req: CacheRequest) -> list[BlockHash]:
        """Chained hashes of the request's full blocks, extended as its tokens grow."""
        hashes = self._hashes.setdefault(req.request_id, [])
        tokens = req.all_token_ids
        if len(tokens) // self.block_size > len(hashes):
            parent = hashes[-1] if hashes else (hash_block_tokens(None, [], req.cache_salt) if req.cache_salt else None)
            hashes.extend(hash_request_blocks(tokens, self.block_size, len(hashes), parent))
        return hashes

    def get_computed_blocks(self, req: CacheRequest) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of a request not yet started: (blocks, number of tokens they hold).
        At least one token is always left to compute, so the step produces logits. The caller
        records the lookup with `record_lookup` once the request is really scheduled."""
        if not self._caches(req):
            return [], 0
        n_tokens = len(req.all_token_ids)
        max_blocks = (n_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in self.block_hashes(req)[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.pool.stats.queries += num_tokens
            self.pool.stats.hits += num_hit_tokens

    def allocate_slots(self, req: CacheRequest, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = (), num_lookahead_tokens: int = 0) -> bool:
        """Make room for `num_new_tokens` tokens after the computed ones (plus prefix-cache hits and
        lookahead slots for draft tokens). Returns False, changing nothing, when blocks run out."""
        blocks = self.req_blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens + num_lookahead_tokens
        need = max(0, cdiv(total, self.block_size) - len(blocks) - len(new_computed_blocks))
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)  # hits that leave the free queue
        if need + revived > self.pool.num_free_blocks:
            return False
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        if need:
            blocks.extend(self.pool.get_new_blocks(need))
        if self._caches(req):
            n_full = min(num_computed + num_new_tokens, len(req.all_token_ids)) // self.block_size
            start = self._num_registered.get(req.request_id, 0)
            if n_full > start:
                hashes = self.block_hashes(req)
                for i in range(start, n_full):
                    self.pool.cache_block(blocks[i], hashes[i])
                self._num_registered[req.request_id] = n_full
        return True

    def free(self, req: CacheRequest) -> None:
        """Release a finished, aborted or preempted request's blocks (tail first, so a shared prefix
        outlives the request's own last blocks). Blocks registered for tokens not yet computed
        (a request preempted in the step that allocated them) are dropped from the cache."""
        blocks = self.req_blocks.pop(req.request_id, [])
        valid = req.num_computed_tokens // self.block_size
        for block in blocks[valid:]:
            if block.block_hash is not None and block.ref_cnt == 1:
                self.pool.uncache(block)
        self.pool.free_blocks(reversed(blocks))
        self._num_registered.pop(req.request_id, None)

    def forget(self, req: CacheRequest) -> None:
        """Drop per-request bookkeeping for a request that is gone for good."""
        self._hashes.pop(req.request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))
