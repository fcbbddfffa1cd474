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

Groups (vLLM's hybrid allocator, llmopt/cache/groups.py): with layers of different windows, each
group keeps its own table per request from the one pool, and frees by its own window; a prefix
hit is the longest every group can take (`GroupTables.longest_hit`). `get_block_ids` is the first
group's table (a full-attention one when there is one), `get_group_block_ids` every group's.

A second tier (`offload`, llmopt/cache/offload.py): a cached block the pool evicts is saved there;
`get_computed_blocks` goes on looking there where the pool's hits stop (TierHit entries), and
`allocate_slots` gives each such hit a fresh block to load it into. A preempted request's full
blocks stay cached when freed, so on resuming it finds them in the pool or the tier instead of
recomputing them. The step's transfers: `take_transfers`.

KIVI 2-bit (`kivi`, llmopt/cache/kivi.py): a request's table is its quantized blocks (main pool) then
its residual blocks (a second pool, full precision). `allocate_slots` converts the blocks the request's
computed tokens have pushed out of the residual window into fresh main blocks (queued for the runner,
`take_kivi_work`) and registers them in the prefix cache then, not before: only quantized blocks are
shared. A fork shares the leader's quantized blocks and copies its residual.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from llmopt.cache.block_pool import BlockHash, BlockPool, KVBlock, hash_request_blocks
from llmopt.cache.groups import GroupTables, cdiv
from llmopt.cache.kivi import KiviConfig, ResidualTables, quantized_blocks
from llmopt.cache.offload import OffloadIndex, TierHit


class CacheRequest(Protocol):
    request_id: str
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> Sequence[int]: ...


NULL_BLOCK_ID = 0   # the table entry of a freed (out-of-window) block: any valid id, never read


def request_blocks(length: int, block_size: int, window: int | None = None, max_num_batched_tokens: int = 0) -> int:
    """The most blocks a request of `length` tokens holds: all of them, or under a sliding window the
    window plus one step's tokens, +1 as the window need not start at a block boundary (vLLM's
    SlidingWindowSpec.max_memory_usage_bytes). max_num_batched_tokens 0: a whole context a step."""
    if not window:
        return cdiv(length, block_size)
    return cdiv(min(window - 1 + (max_num_batched_tokens or length), length), block_size) + 1


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, offload: OffloadIndex | None = None,
                 group_windows: Sequence[int | None] | None = None, kivi: KiviConfig | None = None,
                 num_residual_blocks: int = 0) -> None:
        """group_windows: the window of each KV-cache group (hybrid models), else one group of
        `sliding_window`. kivi: a KIVI 2-bit cache with `num_residual_blocks` full-precision blocks
        (block_size = its group size; one group, no window)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        windows = list(group_windows) if group_windows is not None else [sliding_window]
        self.groups = [GroupTables(i, w, block_size) for i, w in enumerate(windows)]
        self.offload = offload if enable_prefix_caching else None
        on_evict = (lambda block, h: self.offload.plan_save(block.block_id, h)) if self.offload is not None else None
        self.pool = BlockPool(num_blocks, on_evict=on_evict)  # caching decided here, per request
        self._hashes: dict[str, list[BlockHash]] = {}
        self.copies: list[tuple[int, int]] = []     # (src, dst) block copies the next forward must do first
        self.kivi = ResidualTables(num_residual_blocks, kivi) if kivi is not None else None

    @property
    def sliding_window(self) -> int | None:
        """The window of a one-group cache (None: full attention, or several groups)."""
        return self.groups[0].window if len(self.groups) == 1 else None

    @property
    def frees_blocks(self) -> bool:
        return any(g.window for g in self.groups)

    def keep_all_blocks(self) -> None:
        """Free nothing by window from now on (a proposer reads every block of a request)."""
        for g in self.groups:
            g.window = None

    @property
    def req_blocks(self) -> dict[str, list[KVBlock | None]]:
        """The first group's blocks per request (every group holds the same requests)."""
        return self.groups[0].blocks

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

    def get_computed_blocks(self, req: CacheRequest, max_tokens: int | None = None):
        """Longest cached prefix of a request not yet started, of at most `max_tokens` tokens:
        (blocks, number of tokens they hold): pool blocks, else blocks found in the offload tier
        (TierHit), None where a windowed group does not need the block; with several groups, a
        list of them per group. At least one token is always left to compute, so the step
        produces logits. The caller records the lookup with `record_lookup` once the request is
        really scheduled, and passes the blocks to `allocate_slots`."""
        if not self.enable_prefix_caching:
            return [] if len(self.groups) == 1 else [[] for _ in self.groups], 0
        n_tokens = len(req.all_token_ids) if max_tokens is None else min(len(req.all_token_ids), max_tokens + 1)
        hashes = self.block_hashes(req)[:(n_tokens - 1) // self.block_size]
        if self.kivi is not None:   # no more pages than KIVI holds for the whole prompt (the tokens after the
            cfg = self.kivi.config   # hit still read them quantized where a cold, chunked prefill read some in full)
            hashes = hashes[:quantized_blocks(len(req.all_token_ids), cfg.group_size, cfg.residual_length)]
        found = [[self._find(g.key(h)) for h in hashes] for g in self.groups]
        k = len(hashes)
        while True:   # the longest every group can take (a window's need moves with the hit's end)
            k2 = min(g.longest_hit([f is not None for f in found[g.index]], k) for g in self.groups)
            if k2 == k:
                break
            k = k2
        hits = [[f if i >= k - g.needed() or g.needed() < 0 else None for i, f in enumerate(found[g.index][:k])]
                for g in self.groups]
        return (hits[0] if len(self.groups) == 1 else hits), k * self.block_size

    def _find(self, key: BlockHash) -> KVBlock | TierHit | None:
        block = self.pool.get_cached_block(key)   # the pool first, then the tier
        if block is None and self.offload is not None:
            slot = self.offload.lookup(key)
            return None if slot is None else TierHit(key, slot)
        return block

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.pool.stats.queries += num_tokens
            self.pool.stats.hits += num_hit_tokens

    def allocate_slots(self, req: CacheRequest, num_new_tokens: int, new_computed_blocks=(),
                       num_lookahead_tokens: int = 0) -> bool:
        """Make room for `num_new_tokens` tokens after the computed ones (plus the prefix hits of
        `get_computed_blocks`, a fresh block loaded for each one found in the tier, and lookahead
        slots for draft tokens) in every group. Returns False, changing nothing, when blocks run out."""
        rid = req.request_id
        per_group = [list(new_computed_blocks)] if len(self.groups) == 1 else \
            [list(h) for h in new_computed_blocks] or [[] for _ in self.groups]
        num_computed = req.num_computed_tokens + len(per_group[0]) * self.block_size
        total = num_computed + num_new_tokens + num_lookahead_tokens
        plans, cost, residual = [], 0, (0, 0)
        for g, hits in zip(self.groups, per_group):
            blocks = g.blocks.setdefault(rid, [])
            skipped = g.skipped(num_computed)
            self._remove_skipped_blocks(blocks, skipped)
            hits = [None if len(blocks) + i < skipped else b for i, b in enumerate(hits)]   # out of the window
            if self.kivi is not None:   # main blocks only for the blocks converted now
                residual = self.kivi.plan(rid, len(blocks) + len(hits), num_computed, total)
                need = residual[0]
            else:
                need = max(0, cdiv(total, self.block_size) - len(blocks) - len(hits))
            taken = [b for b in hits if isinstance(b, KVBlock)]
            loads = [i for i, b in enumerate(hits) if isinstance(b, TierHit)]
            cow = self._shared_partial_block(req, blocks)
            cost += need + len(loads) + sum(1 for b in taken if b.ref_cnt == 0) + (cow is not None)
            plans.append((g, blocks, hits, need, taken, loads, cow))
        # (a conversion frees its residual block before the request's new ones are taken)
        if cost > self.pool.num_free_blocks or (self.kivi is not None
                                                and residual[1] > self.kivi.pool.num_free_blocks + residual[0]):
            return False
        # every group's hits first: no group's new blocks may evict another's free cached hit, nor
        # a save reuse a tier slot a hit will load
        if self.offload is not None:
            self.offload.pin(hits[i].slot for _, _, hits, _, _, loads, _ in plans for i in loads)
            loaded = {i for _, _, _, _, _, loads, _ in plans for i in loads}
            self.offload.stats.hit_tokens += len(loaded) * self.block_size   # positions, not groups
        for _, _, _, _, taken, _, _ in plans:
            self.pool.touch(taken)
        for g, blocks, hits, need, taken, loads, cow in plans:
            if cow is not None:
                (copy,) = self.pool.get_new_blocks(1)
                self.copies.append((blocks[cow].block_id, copy.block_id))
                self.pool.free_blocks([blocks[cow]])
                blocks[cow] = copy
            for i in loads:
                (fresh,) = self.pool.get_new_blocks(1)
                self.offload.plan_load(hits[i].slot, fresh.block_id)
                hits[i] = fresh
            blocks.extend(hits)
            fresh = self.pool.get_new_blocks(need) if need else []
            blocks.extend(fresh)
            if self.kivi is not None:   # (KIVI: fresh are the conversions' pages)
                self.kivi.take(rid, fresh, residual[1])
            if self.enable_prefix_caching:
                n_full = len(blocks) if self.kivi is not None else \
                    min(num_computed + num_new_tokens, len(req.all_token_ids)) // self.block_size
                start = g.num_registered.get(rid, 0)
                if n_full > start:
                    hashes = self.block_hashes(req)
                    for i in range(start, n_full):
                        if blocks[i] is not None:
                            self.pool.cache_block(blocks[i], g.key(hashes[i]))
                    g.num_registered[rid] = n_full
        return True

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
        """Blocks the request holds now, every group (out-of-window ones freed)."""
        return sum(g.held(request_id) for g in self.groups)

    def _shared_partial_block(self, req: CacheRequest, blocks: list[KVBlock | None]) -> int | None:
        """Index of the block the request writes next if it already holds computed tokens and
        other requests still reference it (a forked prompt's last block), else None."""
        i, used = divmod(req.num_computed_tokens, self.block_size)
        return i if used and i < len(blocks) and blocks[i] is not None and blocks[i].ref_cnt > 1 else None

    def fork(self, parent: CacheRequest, child: CacheRequest, num_tokens: int) -> bool:
        """Give `child` (no blocks yet) the parent's blocks holding its first `num_tokens` tokens,
        the partial last one included; one more reference each. KIVI: the quantized ones shared, the
        residual copied; False (nothing taken) when the residual pool has no room for the copy."""
        if self.kivi is not None:
            held = len(self.groups[0].blocks[parent.request_id])
            if not self.kivi.fork(parent.request_id, child.request_id, cdiv(num_tokens, self.block_size) - held):
                return False
        for g in self.groups:
            shared = g.blocks[parent.request_id][:cdiv(num_tokens, self.block_size)]
            self.pool.touch(b for b in shared if b is not None)
            g.blocks[child.request_id] = list(shared)
            g.num_registered[child.request_id] = min(g.num_registered.get(parent.request_id, 0), len(shared))
        return True

    def take_transfers(self) -> tuple[list[tuple[int, int, BlockHash]], list[tuple[int, int]]]:
        """The offload tier's (saves, loads) queued since the last call: (block, slot, hash), (slot, block)."""
        return self.offload.take_transfers() if self.offload is not None else ([], [])

    def take_kivi_work(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """KIVI: the (residual copies, conversions) queued since the last call."""
        return self.kivi.take_work() if self.kivi is not None else ([], [])

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies queued since the last call."""
        out, self.copies = self.copies, []
        return out

    def free(self, req: CacheRequest) -> None:
        """Release a finished, aborted or preempted request's blocks (tail first, so a shared prefix
        outlives the request's own last blocks). Blocks registered for tokens not yet computed
        (a request preempted in the step that allocated them) are dropped from the cache."""
        valid = req.num_computed_tokens // self.block_size
        gone: set[int] = set()
        for g in self.groups:
            held = g.blocks.pop(req.request_id, [])
            for block in held[valid:]:
                if block is not None and block.block_hash is not None and block.ref_cnt == 1:
                    self.pool.uncache(block)
            blocks = [b for b in held if b is not None]
            self.pool.free_blocks(reversed(blocks))
            g.num_registered.pop(req.request_id, None)
            gone.update(b.block_id for b in blocks)
        if self.copies:  # a copy-on-write target released before its step ran needs no copy
            self.copies = [c for c in self.copies if c[1] not in gone]
        if self.kivi is not None:
            self.kivi.free(req.request_id)
            kept = []
            for r, m in self.kivi.converts:   # into a page freed before its step ran: neither converted, nor
                if self.pool.blocks[m].ref_cnt == 0:   # findable (a later request may take the page this step)
                    self.pool.uncache(self.pool.blocks[m])
                else:
                    kept.append((r, m))
            self.kivi.converts = kept

    def forget(self, req: CacheRequest) -> None:
        """Drop per-request bookkeeping for a request that is gone for good."""
        self._hashes.pop(req.request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The first group's table (NULL_BLOCK_ID where a block was freed); KIVI: its quantized
        blocks, then its residual ones."""
        ids = self._ids(self.groups[0], request_id)
        return ids + self.kivi.ids(request_id) if self.kivi is not None else ids

    def num_quantized_blocks(self, request_id: str) -> int:
        """KIVI: the leading entries of the request's table that are main-pool (quantized) blocks."""
        return len(self.groups[0].blocks.get(request_id, ()))

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        return [self._ids(g, request_id) for g in self.groups]

    @staticmethod
    def _ids(g: GroupTables, request_id: str) -> list[int]:
        return [NULL_BLOCK_ID if b is None else b.block_id for b in g.blocks.get(request_id, ())]
