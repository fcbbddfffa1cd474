"""KIVI's block accounting in the KV-cache manager: a request holds its old groups quantized (main
pool) and its last R..R+G-1 tokens in the residual pool; conversions pair the residual blocks that
leave the window with fresh main blocks; only quantized blocks enter the prefix cache; a fork shares
the quantized blocks and copies the residual; everything comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmopt.cache.kivi import KiviConfig, quantized_blocks, request_blocks
from llmopt.cache.kv_manager import KVCacheManager

G, R = 4, 8


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    extra: list[int] = field(default_factory=list)


def _manager(blocks=64, residual=16, caching=True):
    return KVCacheManager(blocks, G, caching, kivi=KiviConfig(G, R), num_residual_blocks=residual)


def _step(kv, req, n):
    """Schedule n tokens of req, then mark them computed (as update_from_output does)."""
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n


def test_decode_keeps_the_rule_and_converts_the_blocks_leaving_the_window():
    kv = _manager()
    req = Req("a", list(range(100)))
    _step(kv, req, 13)                        # a prompt chunk: all residual (conversion waits for the next step)
    assert kv.num_quantized_blocks("a") == 0 and len(kv.kivi.blocks["a"]) == 4
    residual_before = kv.kivi.ids("a")
    while req.num_computed_tokens < 60:
        before = kv.kivi.ids("a")
        _step(kv, req, 1)
        q = kv.num_quantized_blocks("a")
        assert q == quantized_blocks(req.num_computed_tokens - 1, G, R)   # computed before this step's token
        assert len(kv.kivi.blocks["a"]) <= request_blocks(req.num_computed_tokens, G, R)[1]   # what pools plan
        ids = kv.get_block_ids("a")
        assert len(ids) == q + len(kv.kivi.blocks["a"]) and ids[q:] == kv.kivi.ids("a")
        _, converts = kv.take_kivi_work()
        assert [c[0] for c in converts] == before[:len(converts)]     # the oldest residual blocks, in order
        assert [c[1] for c in converts] == ids[q - len(converts):q]
    assert residual_before[0] not in kv.kivi.ids("a")
    kv.free(req)
    assert kv.pool.num_free_blocks == 64 and kv.kivi.pool.num_free_blocks == 16
    kv.pool.check_invariants()
    kv.kivi.pool.check_invariants()


def test_only_quantized_blocks_are_shared_through_the_prefix_cache():
    kv = _manager()
    a = Req("a", list(range(40)))
    _step(kv, a, 40)
    hits, n = kv.get_computed_blocks(Req("b", list(range(40))))
    assert n == 0                             # nothing is quantized yet
    a.all_token_ids.append(99)
    _step(kv, a, 1)                           # converts (40 - 8) // 4 = 8 blocks
    assert kv.num_quantized_blocks("a") == 8
    b = Req("b", list(range(40)) + [7])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 * G and [h.block_id for h in hits] == kv.get_block_ids("a")[:8]
    assert kv.allocate_slots(b, len(b.all_token_ids) - n, hits)
    assert kv.num_quantized_blocks("b") == 8 and len(kv.kivi.blocks["b"]) == 3   # 9 tokens left: residual
    assert kv.get_block_ids("b")[:8] == kv.get_block_ids("a")[:8]


def test_a_fork_shares_the_quantized_blocks_and_copies_the_residual():
    kv = _manager()
    a = Req("a", list(range(30)))
    _step(kv, a, 30)
    a.all_token_ids.append(1)
    _step(kv, a, 1)
    kv.take_kivi_work()
    c = Req("c", list(a.all_token_ids))
    assert kv.fork(a, c, 31)
    q = kv.num_quantized_blocks("a")
    assert q == 5 and kv.get_block_ids("c")[:q] == kv.get_block_ids("a")[:q]
    copies, _ = kv.take_kivi_work()
    assert [s for s, _ in copies] == kv.kivi.ids("a") and [d for _, d in copies] == kv.kivi.ids("c")
    assert not set(kv.kivi.ids("a")) & set(kv.kivi.ids("c"))
    small = _manager(residual=4)
    a = Req("a", list(range(12)))
    _step(small, a, 12)                       # 3 residual blocks of 4: no room for a copy
    assert not small.fork(a, Req("d", list(a.all_token_ids)), 12)
    assert "d" not in small.kivi.blocks and "d" not in small.groups[0].blocks


def test_a_full_residual_pool_refuses_without_changing_anything():
    kv = _manager(residual=3)
    a = Req("a", list(range(20)))
    assert not kv.allocate_slots(a, 13)       # 4 residual blocks needed
    assert kv.kivi.pool.num_free_blocks == 3 and kv.pool.num_free_blocks == 64
    assert kv.allocate_slots(a, 12)


def test_a_pending_conversion_target_is_never_saved_to_the_tier_before_it_is_written():
    kv = _manager()
    a = Req("a", list(range(30)))
    _step(kv, a, 30)
    a.all_token_ids.append(1)
    assert kv.allocate_slots(a, 1)            # queues 5 conversions
    converted = kv.get_block_ids("a")[:5]
    kv.free(a)                                # preempted in the same step: its targets are not findable
    assert all(kv.pool.blocks[b].block_hash is None for b in converted)
    kv.pool.check_invariants()


def test_a_request_preempted_in_its_conversion_step_leaves_no_conversion_behind():
    """Under the priority policy the victim may already hold this step's conversions: its pages go
    back to the pool with them dropped, so no page is converted twice (into another request's page)."""
    from llmopt.core.request import Request
    from llmopt.core.sampler import SampledTokens
    from llmopt.core.sampling_params import SamplingParams
    from llmopt.core.scheduler import Scheduler

    def req(rid, tokens, priority):
        return Request(rid, tokens, SamplingParams(max_tokens=40, ignore_eos=True), eos_token_ids=frozenset([1]),
                       priority=priority)

    def step(sched):
        out = sched.schedule()
        sched.update_from_output(out, {s.request_id: SampledTokens([5]) for s in out.scheduled if s.num_logits})
        return out

    preempted = 0
    for pool in range(1, 6):
        kv = KVCacheManager(pool, G, True, kivi=KiviConfig(G, R), num_residual_blocks=32)
        sched = Scheduler(kv, 8, 100, 256, "priority")
        sched.add_request(req("lo", list(range(1, 12)), 5))
        step(sched)                                   # lo runs alone, first in the running list
        sched.add_request(req("hi", list(range(100, 112)), 0))
        for _ in range(30):
            out = step(sched)
            pages = [m for _, m in out.kivi_converts]
            assert len(pages) == len(set(pages)), out.kivi_converts
            assert all(kv.pool.blocks[m].ref_cnt > 0 for m in pages)   # every target still someone's
            preempted += len(out.preempted)
        kv.pool.check_invariants()
    assert preempted > 0


def test_prefix_hits_stop_at_the_blocks_kivi_holds_for_the_prompt():
    kv = _manager()
    a = Req("a", list(range(60)))
    _step(kv, a, 60)
    a.all_token_ids.append(1)
    _step(kv, a, 1)                           # (60 - 8) // 4 = 13 pages cached
    assert kv.num_quantized_blocks("a") == 13
    b = Req("b", list(range(30)))             # shares 7 full blocks, KIVI holds (30 - 8) // 4 = 5 of them
    _, n = kv.get_computed_blocks(b)
    assert n == 5 * G


def test_the_residual_check_counts_the_blocks_the_conversions_free_first():
    kv = _manager(residual=4)
    a = Req("a", list(range(40)))
    _step(kv, a, 16)                          # 4 residual blocks: the pool is full
    assert kv.kivi.pool.num_free_blocks == 0
    assert kv.allocate_slots(a, 4)            # converts 2, then needs 1 more for tokens 16-19


def test_a_conversion_of_a_copy_not_run_yet_reads_the_copys_source():
    """A child converting its first residual blocks in the step after its fork converts the leader's
    blocks directly: the copy into a block it frees at once is dropped (that block may be taken, and
    freed, again by another request of the same step, whose free drops copies into its blocks)."""
    kv = _manager()
    a = Req("a", list(range(14)))
    _step(kv, a, 14)
    c = Req("c", list(range(14)))
    assert kv.fork(a, c, 14)
    src = kv.kivi.ids("a")
    c.num_computed_tokens = 14
    c.all_token_ids.append(3)
    assert kv.allocate_slots(c, 1)            # converts (14 - 8) // 4 = 1: its first block, a copy's target
    copies, converts = kv.take_kivi_work()
    assert converts == [(src[0], kv.get_block_ids("c")[0])]
    assert [s for s, _ in copies] == src[1:]  # the copies still needed
