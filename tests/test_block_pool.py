"""Block pool, KV manager and scheduler invariants, without a model: a shadow cache records which
token each slot holds, so a prefix-cache hit serving different tokens cannot go unnoticed."""

import random

import pytest

from llmopt.cache.block_pool import BlockPool, hash_block_tokens, hash_request_blocks
from llmopt.cache.kv_manager import KVCacheManager
from llmopt.engine.request import Request, RequestStatus
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.scheduler import Scheduler
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


class ShadowRunner:
    """Plays the model runner: writes each scheduled token's id into its slot and checks that every
    position a request attends to holds that request's token."""

    def __init__(self, num_blocks, block_size):
        self.slots = [None] * (num_blocks * block_size)
        self.bs = block_size

    def run(self, out, requests):
        for s in out.scheduled:
            for i, tok in enumerate(s.token_ids):
                pos = s.start_pos + i
                self.slots[s.block_ids[pos // self.bs] * self.bs + pos % self.bs] = tok
        for s in out.scheduled:
            seq = requests[s.request_id].all_token_ids
            for pos in range(s.start_pos + len(s.token_ids)):
                got = self.slots[s.block_ids[pos // self.bs] * self.bs + pos % self.bs]
                assert got == seq[pos], f"{s.request_id}: position {pos} holds {got}, expected {seq[pos]}"


@pytest.mark.parametrize("policy,block_size,num_blocks,budget,caching", [
    ("fcfs", 4, 24, 16, True), ("fcfs", 1, 90, 7, True), ("priority", 4, 20, 32, True), ("fcfs", 4, 24, 10_000, False),
])
def test_random_workload_keeps_invariants(policy, block_size, num_blocks, budget, caching):
    rng = random.Random(block_size * 1000 + num_blocks)
    kv = KVCacheManager(num_blocks, block_size, caching)
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=64, policy=policy)
    shadow = ShadowRunner(num_blocks, block_size)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(0, 20))] for _ in range(3)]
    everything = {}
    for i in range(40):
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 25))]
        req = _req(f"r{i}", tokens, rng.randint(1, 20), priority=rng.randint(0, 3), arrival=float(i))
        sched.add_request(req)
        everything[req.request_id] = req
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 5000
        out = sched.schedule()
        assert out.num_batched_tokens <= budget and len(sched.running) <= 6
        shadow.run(out, sched.requests)
        sched.update_after_step(out)
        for s in out.scheduled:
            if s.num_logits:
                req = sched.requests[s.request_id]
                tok = rng.randrange(50)
                req.append_output_token(tok)
                status = req.check_stop_token(tok)
                if status:
                    sched.finish_request(req, status)
        if rng.random() < 0.03 and sched.running:
            sched.abort_request(rng.choice(sched.running).request_id)
        kv.pool.check_invariants()
        assert all(b.ref_cnt >= 0 for b in kv.pool.blocks)
    assert kv.num_free_blocks == num_blocks and not kv.req_blocks
    finished = [r for r in everything.values() if r.status == RequestStatus.FINISHED_LENGTH]
    assert all(r.num_output_tokens == r.max_tokens for r in finished) and len(finished) > 20
    if caching:
        assert kv.stats.hits > 0
    if num_blocks <= 24:
        assert sched.num_preemptions > 0


def test_priority_policy_runs_the_most_urgent_first():
    kv = KVCacheManager(16, 4)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=100, max_model_len=64, policy="priority")
    for rid, prio in (("low", 5), ("high", 0), ("mid", 2)):
        sched.add_request(_req(rid, [1, 2, 3], priority=prio, arrival=0.0))
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["high"]


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
