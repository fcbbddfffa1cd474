"""Block pool and KV manager invariants, without a model: chained hashes, the LRU free queue, ref
counts, prefix hits, the fork of a prompt's blocks and copy-on-write of its partial last block. (The
scheduler's random workload with a shadow cache is in tests/engine/test_scheduler.py.)"""

import pytest

from llmopt.cache.block_pool import BlockPool, hash_block_tokens, hash_request_blocks
from llmopt.cache.kv_manager import KVCacheManager
from llmopt.core.request import Request
from llmopt.core.sampling_params import SamplingParams
from llmopt.errors import LLMOptError


def test_chained_hash_depends_on_parent_and_tokens():
    a = hash_block_tokens(None, [1, 2, 3])
    assert a == hash_block_tokens(None, [1, 2, 3])
    assert a != hash_block_tokens(None, [1, 2, 4])
    assert hash_block_tokens(a, [5, 6, 7]) != hash_block_tokens(hash_block_tokens(None, [1, 2, 4]), [5, 6, 7])
    hs = hash_request_blocks(list(range(10)), 4)
    assert len(hs) == 2 and hs[1] == hash_block_tokens(hs[0], [4, 5, 6, 7])


def test_free_queue_is_lru_and_cached_blocks_survive_until_evicted():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, b"ha")
    pool.cache_block(b, b"hb")
    pool.free_blocks([b, a])          # b freed first: evicted first
    pool.free_blocks([c])             # uncached: handed out before any cached block
    assert pool.num_free_blocks == 4
    assert pool.get_cached_block(b"ha") is a and pool.get_cached_block(b"hb") is b
    first, second = pool.get_new_blocks(2)
    assert {first.block_id, second.block_id} == {c.block_id, 3}
    assert pool.get_cached_block(b"hb") is b
    (third,) = pool.get_new_blocks(1)
    assert third is b and pool.get_cached_block(b"hb") is None and b.block_hash is None
    pool.touch([a])                   # a cached free block comes back to life
    assert a.ref_cnt == 1 and pool.num_free_blocks == 0
    pool.check_invariants()


def test_ref_counts_never_go_negative():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.touch([a])
    pool.free_blocks([a])
    pool.free_blocks([a])
    with pytest.raises(LLMOptError):
        pool.free_blocks([a])
    with pytest.raises(LLMOptError):
        pool.get_new_blocks(3)
    pool.check_invariants()


def _req(rid, tokens, max_tokens=4, priority=0, arrival=None):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority,
                   arrival_time=arrival)


def test_prefix_hits_leave_one_token_and_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = _req("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    b = _req("b", list(range(12)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits] == kv.get_block_ids("a")[:2]  # 12 tokens: 2 blocks, 1 left
    c = _req("c", list(range(8)) + [99, 98, 97, 96, 95])
    hits_c, n_c = kv.get_computed_blocks(c)
    assert n_c == 8
    d = _req("d", [7] * 40)
    free_before = kv.num_free_blocks
    assert not kv.allocate_slots(d, 40)
    assert kv.num_free_blocks == free_before and kv.get_block_ids("d") == []
    kv.free(a)
    kv.free(d)
    assert kv.num_free_blocks == 6
    kv.pool.check_invariants()


def test_blocks_of_a_request_preempted_before_its_step_ran_are_not_served():
    """Full blocks are offered to the cache when their slots are allocated; if the request is
    preempted in that same schedule (its K/V never written), they must leave the cache again."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(13)))
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8                  # the first chunk ran: blocks 0-1 hold K/V
    assert kv.allocate_slots(a, 5)             # second chunk allocated (blocks 2-3 offered to the cache)...
    kv.free(a)                                 # ...but preempted before it ran
    b = _req("b", list(range(13)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and len(hits) == 2
    kv.pool.check_invariants()


def test_fork_shares_every_prompt_block_and_copies_the_partial_one_on_write():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a, b, c = (_req(r, list(range(10))) for r in "abc")
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10                # 2 full blocks + 2 tokens in the third
    for child in (b, c):
        kv.fork(a, child, 10)
        child.num_computed_tokens = 10
    ids = kv.get_block_ids("a")
    assert kv.get_block_ids("b") == kv.get_block_ids("c") == ids and kv.num_free_blocks == 7
    assert [kv.pool.blocks[i].ref_cnt for i in ids] == [3, 3, 3]
    for r in (a, b, c):
        r.all_token_ids.append(99)
    assert kv.allocate_slots(a, 1)            # a writes slot 10: the third block is shared
    assert kv.allocate_slots(b, 1)
    assert kv.allocate_slots(c, 1)            # the last holder writes in place
    copies = kv.take_copies()
    assert [src for src, _ in copies] == [ids[2], ids[2]] and kv.take_copies() == []
    assert kv.get_block_ids("a")[2] == copies[0][1] and kv.get_block_ids("b")[2] == copies[1][1]
    assert kv.get_block_ids("c") == ids and kv.num_free_blocks == 5
    assert [kv.pool.blocks[i].ref_cnt for i in ids] == [3, 3, 1]
    full = _req("full", list(range(8)))       # a prompt ending on a block boundary needs no copy
    assert kv.allocate_slots(full, 8)
    full.num_computed_tokens = 8
    kv.fork(full, _req("f1", list(range(8))), 8)
    full.all_token_ids.append(1)
    assert kv.allocate_slots(full, 1) and kv.take_copies() == []
    for r in (a, b, c, full):
        kv.free(r)
    kv.free(_req("f1", []))
    assert kv.num_free_blocks == 10
    kv.pool.check_invariants()


def test_a_copy_whose_target_is_freed_before_its_step_is_dropped():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a, b = _req("a", [1, 2, 3]), _req("b", [1, 2, 3])
    assert kv.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    kv.fork(a, b, 3)
    b.num_computed_tokens = 3
    assert kv.allocate_slots(a, 1) and len(kv.copies) == 1
    kv.free(a)                                 # preempted in the same schedule
    assert kv.copies == []
    kv.free(b)
    assert kv.num_free_blocks == 6


def test_sliding_window_frees_the_blocks_behind_every_window():
    """Window 6, blocks of 4: computing from position C on frees the blocks wholly before
    C - 6 + 1 (vLLM's SlidingWindowManager), tail first, their table entries the null id; a
    request never holds more than request_blocks(...) blocks; the freed full ones stay cached."""
    from llmopt.cache.kv_manager import NULL_BLOCK_ID, request_blocks
    kv = KVCacheManager(8, 4, sliding_window=6)
    r = _req("a", list(range(10)), max_tokens=40)
    assert kv.allocate_slots(r, 4)                       # a chunk of 4 (max_num_batched_tokens 4)
    r.num_computed_tokens = 4
    most = request_blocks(50, 4, 6, 4)
    assert most == -(-min(6 - 1 + 4, 50) // 4) + 1 == 4
    for step in range(46):
        n = 4 if r.num_computed_tokens < 10 else 1
        if r.num_computed_tokens + n > r.num_tokens:
            n = r.num_tokens - r.num_computed_tokens
        assert kv.allocate_slots(r, n)
        first_useful = max(0, r.num_computed_tokens - 6 + 1) // 4
        ids = kv.get_block_ids("a")
        assert ids[:first_useful] == [NULL_BLOCK_ID] * first_useful
        assert kv.num_held_blocks("a") == len(ids) - first_useful <= most
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.append_output_token(7)
        kv.pool.check_invariants()
    last_freed = max(0, r.num_computed_tokens - 1 - 6 + 1) // 4 - 1
    assert kv.pool.get_cached_block(kv.block_hashes(r)[last_freed]) is not None   # freed, findable until evicted
    kv.free(r)
    assert kv.pool.num_free_blocks == 8
    kv.pool.check_invariants()


def _compute(kv, req, n, hits=()):
    """Allocate and compute the request's next n tokens."""
    assert kv.allocate_slots(req, n, hits)
    req.num_computed_tokens += n


def test_sliding_window_takes_only_the_prefix_hits_its_window_reaches():
    kv = KVCacheManager(16, 4, sliding_window=5)
    a = _req("a", list(range(21)))
    _compute(kv, a, 21)
    kv.free(a)
    b = _req("b", list(range(21)) + [99])
    hits, n = kv.get_computed_blocks(b)
    assert n == 20 and len(hits) == 5
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(b, 2, hits)
    # computing from position 20 on reaches back to 16: the first 4 hits are not taken
    assert kv.get_block_ids("b")[:4] == [0, 0, 0, 0] and kv.num_held_blocks("b") == 2
    assert kv.num_free_blocks == free_before - 2
    kv.free(b)
    assert kv.num_free_blocks == 16
    kv.pool.check_invariants()


def test_fork_under_a_window_shares_only_the_blocks_still_held():
    kv = KVCacheManager(16, 4, sliding_window=4)
    p = _req("p", list(range(14)))
    _compute(kv, p, 8)
    _compute(kv, p, 6)                                     # frees block 0 (positions 0-3 < 8 - 4 + 1)
    c = _req("c", list(range(14)))
    kv.fork(p, c, 14)
    assert kv.get_block_ids("c") == kv.get_block_ids("p") and kv.get_block_ids("c")[0] == 0
    assert kv.num_held_blocks("c") == 3
    c.num_computed_tokens = 14
    c.append_output_token(5)
    assert kv.allocate_slots(c, 1) and kv.copies    # the shared partial block copied on write
    for r in (p, c):
        kv.free(r)
    assert kv.num_free_blocks == 16
    kv.pool.check_invariants()


def test_groups_claim_their_hits_before_any_group_takes_new_blocks():
    """Two groups (full, window 8) over 22 blocks: a request whose hits are free cached blocks
    must not see one group's new blocks evict the other group's hits (a block in two tables)."""
    kv = KVCacheManager(22, 4, group_windows=[None, 8])
    c, a = _req("c", list(range(100, 132))), _req("a", list(range(12)))
    for r in (c, a):
        _compute(kv, r, r.num_tokens)
    kv.free(a)
    kv.free(c)
    b = _req("b", list(range(8)) + list(range(200, 220)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    _compute(kv, b, b.num_tokens - n, hits)
    owned = [blk for g in kv.groups for blk in g.blocks["b"] if blk is not None]
    assert len({id(x) for x in owned}) == len(owned) == kv.num_held_blocks("b")   # no block in two places
    assert all(blk.ref_cnt == 1 for blk in owned)
    kv.free(b)
    assert kv.num_free_blocks == 22
    kv.pool.check_invariants()
