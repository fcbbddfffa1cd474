"""What the scheduler sees of the KV cache: per-request block lists, prefix-cache lookups, slot
allocation for a step's new tokens, and freeing.

A request only needs `request_id`, `all_token_ids` (prompt + outputs so far) and
`num_computed_tokens` (tokens whose K/V are in its blocks). Full blocks are registered in the prefix
cache as soon as slots for them are allocated: within a step every layer writes the K/V of all
tokens before any attention reads them, so a request scheduled later in the same step may already
share them.

Copy-on-write: `fork` gives a new request all of a computed prompt's blocks, its partial last block
included (the n samples of one prompt, whether prefix caching is on or off). Before a request
writes into a partial block that others still reference, `allocate_slots` gives it a private copy
and queues (src, dst) in `copies`; the runner copies those blocks in every layer before the step's
forward (`take_copies`). The last holder writes in place.

Sliding windows (vLLM's SlidingWindowManager): when every layer attends over the last `sliding_window`
positions only, a step computing tokens from position C on reads no key before C - window + 1, so
the blocks wholly before it are freed (tail first; full ones stay findable in the prefix cache
until evicted) and their places in the request's list hold None; `get_block_ids` reports them as
NULL_BLOCK_ID, a block the kernels never read for that request (attention starts at the window).
A request then holds at most `request_blocks(...)` blocks, the figure kv-estimate plans.

A second tier (`offload`, llmopt/cache/offload.py): a cached block the pool evicts is saved there;
`get_computed_blocks` goes on looking there where the pool's hits stop (TierHit entries), and
`allocate_slots` gives each such hit a fresh block to load it into. A preempted request's full
blocks stay cached when freed, so on resuming it finds them in the pool or the tier instead of
recomputing them. The step's transfers: `take_transfers`.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from llmopt.cache.block_pool import BlockHash, BlockPool, KVBlock, hash_request_blocks
from llmopt.cache.offload import OffloadIndex, TierHit


class CacheRequest(Protocol):
    request_id: str
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> Sequence[int]: ...


NULL_BLOCK_ID = 0   # the table entry of a freed (out-of-window) block: any valid id, never read


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def request_blocks(length: int, block_size: int, window: int | None = None, max_num_batched_tokens: int = 0) -> int:
    """The most blocks a request of `length` tokens holds: all of them, or under a sliding window the
    window plus one step's tokens, +1 as the window need not start at a block boundary (vLLM's
    SlidingWindowSpec.max_memory_usage_bytes). max_num_batched_tokens 0: a whole context a step."""
    if not window:
        return cdiv(length, block_size)
    return cdiv(min(window - 1 + (max_num_batched_tokens or length), length), block_size) + 1


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, offload: OffloadIndex | None = None) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window   # every layer's window: out-of-window blocks are freed
        self.offload = offload if enable_prefix_caching else None
        on_evict = (lambda block, h: self.offload.plan_save(block.block_id, h)) if self.offload is not None else None
        self.pool = BlockPool(num_blocks, on_evict=on_evict)  # caching decided here, per request
        self.req_blocks: dict[str, list[KVBlock | None]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks of a request offered to the cache
        self.copies: list[tuple[int, int]] = []     # (src, dst) block copies the next forward must do first

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def stats(self):
        return self.pool.stats

    def block_hashes(self, req: CacheRequest) -> list[BlockHash]:
        """Chained hashes of the request's full blocks, extended as its tokens grow."""
        hashes = self._hashes.setdefault(req.request_id, [])
        tokens = req.all_token_ids
        if len(tokens) // self.block_size > len(hashes):
            hashes.extend(hash_request_blocks(tokens, self.block_size, len(hashes), hashes[-1] if hashes else None))
        return hashes

    def get_computed_blocks(self, req: CacheRequest, max_tokens: int | None = None
                            ) -> tuple[list[KVBlock | TierHit], int]:
        """Longest cached prefix of a request not yet started, of at most `max_tokens` tokens:
        (blocks, number of tokens they hold): pool blocks, then blocks found in the offload tier.
        At least one token is always left to compute, so the step produces logits. The caller
        records the lookup with `record_lookup` once the request is really scheduled."""
        if not self.enable_prefix_caching:
            return [], 0
        n_tokens = len(req.all_token_ids) if max_tokens is None else min(len(req.all_token_ids), max_tokens + 1)
        max_blocks = (n_tokens - 1) // self.block_size
        hits: list[KVBlock | TierHit] = []
        for h in self.block_hashes(req)[:max_blocks]:
            block = self.pool.get_cached_block(h)   # the pool first, then the tier
            if block is None:
                slot = self.offload.lookup(h) if self.offload is not None else None
                if slot is None:
                    break
                block = TierHit(h, slot)
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.pool.stats.queries += num_tokens
            self.pool.stats.hits += num_hit_tokens

    def allocate_slots(self, req: CacheRequest, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock | TierHit] = (), num_lookahead_tokens: int = 0) -> bool:
        """Make room for `num_new_tokens` tokens after the computed ones (plus prefix-cache hits, a
        fresh block loaded for each one found in the tier, and lookahead slots for draft tokens).
        Returns False, changing nothing, when blocks run out."""
        blocks = self.req_blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        skipped = self._skipped_blocks(num_computed)
        self._remove_skipped_blocks(blocks, skipped)
        # hits no window reaches are not taken (None in their places)
        new_computed_blocks = [None if len(blocks) + i < skipped else b for i, b in enumerate(new_computed_blocks)]
        total = num_computed + num_new_tokens + num_lookahead_tokens
        need = max(0, cdiv(total, self.block_size) - len(blocks) - len(new_computed_blocks))
        taken = [b for b in new_computed_blocks if isinstance(b, KVBlock)]
        loads = [i for i, b in enumerate(new_computed_blocks) if isinstance(b, TierHit)]
        revived = sum(1 for b in taken if b.ref_cnt == 0)  # hits that leave the free queue
        cow = self._shared_partial_block(req, blocks)
        if need + len(loads) + revived + (cow is not None) > self.pool.num_free_blocks:
            return False
        if loads:   # before any eviction below can plan a save over them
            self.offload.pin(new_computed_blocks[i].slot for i in loads)
        if cow is not None:
            (copy,) = self.pool.get_new_blocks(1)
            self.copies.append((blocks[cow].block_id, copy.block_id))
            self.pool.free_blocks([blocks[cow]])
            blocks[cow] = copy
        if new_computed_blocks:
            self.pool.touch(taken)
            for i in loads:
                (fresh,) = self.pool.get_new_blocks(1)
                self.offload.plan_load(new_computed_blocks[i].slot, fresh.block_id)
                new_computed_blocks[i] = fresh
            blocks.extend(new_computed_blocks)
        if need:
            blocks.extend(self.pool.get_new_blocks(need))
        if self.enable_prefix_caching:
            n_full = min(num_computed + num_new_tokens, len(req.all_token_ids)) // self.block_size
            start = self._num_registered.get(req.request_id, 0)
            if n_full > start:
                hashes = self.block_hashes(req)
                for i in range(start, n_full):
                    if blocks[i] is not None:
                        self.pool.cache_block(blocks[i], hashes[i])
                self._num_registered[req.request_id] = n_full
        return True

    def _skipped_blocks(self, num_computed: int) -> int:
        """Leading blocks no token from position num_computed on attends to (0 without a window)."""
        if not self.sliding_window:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def _remove_skipped_blocks(self, blocks: list[KVBlock | None], skipped: int) -> None:
        """Free the request's blocks before index `skipped`, the tail first (the head of a cached
        prefix is evicted last); None takes their places."""
        freed = []
        for i in range(min(skipped, len(blocks)) - 1, -1, -1):
            if blocks[i] is None:
                break
            freed.append(blocks[i])
            blocks[i] = None
        if freed:
            self.pool.free_blocks(freed)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (out-of-window ones freed)."""
        return sum(b is not None for b in self.req_blocks.get(request_id, ()))

    def _shared_partial_block(self, req: CacheRequest, blocks: list[KVBlock | None]) -> int | None:
        """Index of the block the request writes next if it already holds computed tokens and
        other requests still reference it (a forked prompt's last block), else None."""
        i, used = divmod(req.num_computed_tokens, self.block_size)
        return i if used and i < len(blocks) and blocks[i] is not None and blocks[i].ref_cnt > 1 else None

    def fork(self, parent: CacheRequest, child: CacheRequest, num_tokens: int) -> None:
        """Give `child` (no blocks yet) the parent's blocks holding its first `num_tokens` tokens,
        the partial last one included; one more reference each."""
        shared = self.req_blocks[parent.request_id][:cdiv(num_tokens, self.block_size)]
        self.pool.touch(b for b in shared if b is not None)
        self.req_blocks[child.request_id] = list(shared)
        self._num_registered[child.request_id] = min(self._num_registered.get(parent.request_id, 0), len(shared))

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The offload tier's (saves, loads) queued since the last call: (block, slot), (slot, block)."""
        return self.offload.take_transfers() if self.offload is not None else ([], [])

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies queued since the last call."""
        out, self.copies = self.copies, []
        return out

    def free(self, req: CacheRequest) -> None:
        """Release a finished, aborted or preempted request's blocks (tail first, so a shared prefix
        outlives the request's own last blocks). Blocks registered for tokens not yet computed
        (a request preempted in the step that allocated them) are dropped from the cache."""
        held = self.req_blocks.pop(req.request_id, [])
        valid = req.num_computed_tokens // self.block_size
        for block in held[valid:]:
            if block is not None and block.block_hash is not None and block.ref_cnt == 1:
                self.pool.uncache(block)
        blocks = [b for b in held if b is not None]
        self.pool.free_blocks(reversed(blocks))
        self._num_registered.pop(req.request_id, None)
        if self.copies:  # a copy-on-write target released before its step ran needs no copy
            gone = {b.block_id for b in blocks}
            self.copies = [c for c in self.copies if c[1] not in gone]

    def forget(self, req: CacheRequest) -> None:
        """Drop per-request bookkeeping for a request that is gone for good."""
        self._hashes.pop(req.request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [NULL_BLOCK_ID if b is None else b.block_id for b in self.req_blocks.get(request_id, ())]
