"""The scheduler on its own, without a model: token budget and chunked prefill, max_num_seqs,
preemption order, update_from_output (accepted tokens, EOS / stop ids / stop strings across tokens /
min_tokens / max_tokens, the rewind of rejected drafts), the fork of n samples with copy-on-write,
and a random workload whose every attended position is checked against a shadow cache."""

import random

import pytest

from llmopt.cache.kv_manager import KVCacheManager
from llmopt.engine.detokenizer import IncrementalDetokenizer
from llmopt.core.request import Request, RequestStatus
from llmopt.core.sampler import SampledTokens
from llmopt.core.sampling_params import SamplingParams
from llmopt.core.scheduler import Scheduler

EOS = 0


def _req(rid, tokens, max_tokens=4, priority=0, arrival=None, detokenizer=None, **params):
    params.setdefault("ignore_eos", "min_tokens" not in params and "stop" not in params)
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=frozenset([EOS]),
                   priority=priority, arrival_time=arrival, detokenizer=detokenizer)


def _sched(num_blocks=64, block_size=4, budget=100, max_num_seqs=8, policy="fcfs", caching=True):
    return Scheduler(KVCacheManager(num_blocks, block_size, caching), max_num_seqs, budget, 256, policy)


def _step(sched, tokens: dict[str, list[int]]):
    """One schedule + update, sampling `tokens[rid]` (padded with 5s) for every row that samples."""
    out = sched.schedule()
    sampled = {}
    for s in out.scheduled:
        for rid, m in [(s.request_id, s.num_logits)] + [(f, 1) for f in s.fork_ids]:
            if s.num_logits:
                sampled[rid] = SampledTokens((tokens.get(rid, []) + [5] * m)[:m])
    return out, sched.update_from_output(out, sampled)


def test_budget_chunks_a_long_prompt_and_running_requests_go_first():
    sched = _sched(budget=8)
    a = _req("a", list(range(1, 21)), max_tokens=3)
    sched.add_request(a)
    out, _ = _step(sched, {})
    assert [(s.request_id, s.start_pos, len(s.token_ids), s.num_logits) for s in out.scheduled] == [("a", 0, 8, 0)]
    b = _req("b", [7, 8, 9])
    sched.add_request(b)
    out, _ = _step(sched, {})                   # a's next chunk first, then b in what is left (0)
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in out.scheduled] == [("a", 8, 8)]
    out, progressed = _step(sched, {"a": [42]})  # a's last 4 prompt tokens sample; b gets the other 4 of the budget
    assert [(s.request_id, s.start_pos, len(s.token_ids), s.num_logits) for s in out.scheduled] == \
        [("a", 16, 4, 1), ("b", 0, 3, 1)]
    assert out.num_batched_tokens == 7 and progressed == [a, b]
    assert a.output_token_ids == [42] and a.num_computed_tokens == 20 == a.num_tokens - 1
    out, _ = _step(sched, {})                    # decodes: one token each
    assert [(s.request_id, s.token_ids, s.num_logits) for s in out.scheduled] == [("a", [42], 1), ("b", [5], 1)]


def test_max_num_seqs_and_a_group_of_samples_counts_whole():
    sched = _sched(max_num_seqs=3)
    for i in range(2):
        sched.add_request(_req(f"r{i}", [1, 2, 3]))
    sched.add_request(_req("g", [4, 5, 6]), [_req("g#1", [4, 5, 6])])   # needs 2 seats
    out, _ = _step(sched, {})
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"] and len(sched.waiting) == 1


@pytest.mark.parametrize("policy,victim", [("fcfs", "y"), ("priority", "x")])
def test_preemption_frees_the_last_admitted_or_the_least_urgent(policy, victim):
    sched = _sched(num_blocks=6, block_size=4, policy=policy)
    x = _req("x", [1] * 7, max_tokens=20, priority=2, arrival=0.0)
    z = _req("z", [3] * 7, max_tokens=20, priority=1, arrival=1.0)
    y = _req("y", [2] * 7, max_tokens=20, priority=0, arrival=2.0)
    sched.add_request(x)
    sched.add_request(z)
    _step(sched, {})
    sched.add_request(y)                        # arrives later, most urgent
    _step(sched, {})                            # x, z decode inside their 2nd block; y takes the last 2
    assert set(sched.running) == {x, z, y} and sched.running[-1] is y and sched.kv.num_free_blocks == 0
    out, _ = _step(sched, {})                   # x and z cross into a 3rd block: someone must go
    assert out.preempted == [victim] and victim not in [s.request_id for s in out.scheduled]
    v = sched.requests[victim]
    assert v.status == RequestStatus.PREEMPTED and v.num_computed_tokens == 0 and sched.waiting.peek() is v
    assert sched.num_preemptions == 1 and v.num_output_tokens >= 1   # its sampled tokens are kept


def _decoding(sched, rid, prompt, **params):
    req = _req(rid, prompt, **params)
    sched.add_request(req)
    _step(sched, {rid: [50]})
    return req


def test_stop_token_ids_eos_min_tokens_and_max_tokens():
    sched = _sched()
    a = _req("a", [1, 2], max_tokens=10, stop_token_ids=[77])
    b = _req("b", [1, 2], max_tokens=10, ignore_eos=False)
    c = _req("c", [1, 2], max_tokens=10, min_tokens=3, stop_token_ids=[77])
    d = _req("d", [1, 2], max_tokens=2)
    for r in (a, b, c, d):
        sched.add_request(r)
    _step(sched, {rid: [50] for rid in "abcd"})
    _step(sched, {"a": [77], "b": [EOS], "c": [77], "d": [EOS]})
    assert (a.finish_reason, a.stop_reason, a.output_token_ids) == ("stop", 77, [50, 77])
    assert (b.finish_reason, b.stop_reason) == ("stop", None)
    assert c.status == RequestStatus.RUNNING                       # 2 outputs < min_tokens 3
    assert (d.finish_reason, d.output_token_ids) == ("length", [50, EOS])  # ignore_eos, then max_tokens
    _step(sched, {"c": [77]})
    assert (c.finish_reason, c.stop_reason, c.num_output_tokens) == ("stop", 77, 3)
    assert not sched.requests and sched.kv.num_free_blocks == 64


class CharTokenizer:
    """Token i decodes to VOCAB[i]; enough for the incremental detokenizer."""
    VOCAB = ["<eos>", "he", "llo", " wor", "ld", "!", " hel", "lo"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.VOCAB[i] for i in ids if not (skip_special_tokens and i == 0))


def _texted(sched, rid, prompt=(5,), **params):
    req = _req(rid, list(prompt), detokenizer=IncrementalDetokenizer(CharTokenizer(), list(prompt)), **params)
    sched.add_request(req)
    return req


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(include):
    sched = _sched()
    r = _texted(sched, "r", max_tokens=10, stop=["lo wo"], include_stop_str_in_output=include)
    for tok in (1, 2, 3):            # "he" "llo" " wor": the stop string spans the last two tokens
        _step(sched, {"r": [tok]})
    assert (r.finish_reason, r.stop_reason) == ("stop", "lo wo")
    assert r.text == ("hello wo" if include else "hel") and r.output_token_ids == [1, 2, 3]


def test_stop_string_waits_for_min_tokens_and_beats_the_length_limit():
    sched = _sched()
    early = _texted(sched, "early", max_tokens=10, stop=["hello"], min_tokens=3)
    last = _texted(sched, "last", max_tokens=2, stop=["llo"])
    _step(sched, {"early": [1], "last": [1]})
    _step(sched, {"early": [2], "last": [2]})   # "hello" before min_tokens: not a stop
    assert early.status == RequestStatus.RUNNING and early.text == "hello"
    assert (last.finish_reason, last.stop_reason, last.text) == ("stop", "llo", "he")  # stop, not length
    _step(sched, {"early": [6]})
    _step(sched, {"early": [7]})               # " hel" "lo": a new "hello" after min_tokens
    assert (early.finish_reason, early.text) == ("stop", "hello ")


def test_drafts_accepted_up_to_the_first_mismatch_and_the_rest_rewound():
    sched = _sched(block_size=4)
    r = _decoding(sched, "r", [1, 2, 3], max_tokens=20)
    r.spec_token_ids = [60, 61, 62]
    out, _ = _step(sched, {"r": [60, 61, 99, 70]})      # drafts 60, 61 right; 62 wrong: the target's 99
    (s,) = out.scheduled
    assert s.token_ids == [50, 60, 61, 62] and s.num_logits == 4 and s.spec_token_ids == [60, 61, 62]
    assert r.output_token_ids == [50, 60, 61, 99] and r.spec_token_ids == []
    assert r.num_computed_tokens == r.num_tokens - 1 == 6   # the K/V of draft 62 are stale
    r.spec_token_ids = [1, 2]
    _step(sched, {"r": [1, 2, 3]})                           # all right: plus the bonus token
    assert r.output_token_ids[-3:] == [1, 2, 3] and r.num_computed_tokens == r.num_tokens - 1
    r.spec_token_ids = [8, 9]
    _step(sched, {"r": [7, 9, 9]})                           # first wrong: only the target's token
    assert r.output_token_ids[-1] == 7 and r.num_computed_tokens == r.num_tokens - 1
    assert sched.schedule().scheduled[0].token_ids == [7]


def test_a_stop_inside_accepted_drafts_ends_the_request_there():
    sched = _sched()
    r = _req("r", [1, 2, 3], max_tokens=20, stop_token_ids=[61])
    m = _req("m", [1, 2, 3], max_tokens=3)
    sched.add_request(r)
    sched.add_request(m)
    _step(sched, {"r": [50], "m": [50]})
    r.spec_token_ids, m.spec_token_ids = [60, 61, 62], [60, 61]
    _step(sched, {"r": [60, 61, 62, 63], "m": [60, 61, 62]})
    assert (r.finish_reason, r.output_token_ids) == ("stop", [50, 60, 61])
    assert (m.finish_reason, m.output_token_ids) == ("length", [50, 60, 61])   # max_tokens 3
    assert sched.kv.num_free_blocks == 64


def test_samples_fork_from_the_computed_prompt_and_copy_the_shared_partial_block():
    sched = _sched(block_size=4)
    kids = [_req(f"g#{i}", list(range(1, 11)), max_tokens=5) for i in range(3)]
    sched.add_request(kids[0], kids[1:])
    out, progressed = _step(sched, {"g#0": [20], "g#1": [21], "g#2": [22]})
    assert [(s.request_id, s.fork_ids) for s in out.scheduled] == [("g#0", ["g#1", "g#2"])]
    assert progressed == kids and [k.output_token_ids for k in kids] == [[20], [21], [22]]
    tables = [sched.kv.get_block_ids(k.request_id) for k in kids]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3          # 10 tokens: 2 full + 1 partial
    assert all(k.num_computed_tokens == 10 and k.metrics.first_scheduled_time is not None for k in kids)
    out, _ = _step(sched, {})
    shared = tables[0][2]
    assert [src for src, _ in out.blocks_to_copy] == [shared, shared]           # the last one writes in place
    new_tables = [s.block_ids for s in out.scheduled]
    assert [t[:2] for t in new_tables] == [tables[0][:2]] * 3 and new_tables[2][2] == shared
    assert {dst for _, dst in out.blocks_to_copy} == {new_tables[0][2], new_tables[1][2]}
    assert sched.kv.pool.num_blocks - sched.kv.num_free_blocks == 3 + 2


def test_aborting_the_first_sample_before_its_prompt_ran_hands_the_prompt_on():
    sched = _sched()
    kids = [_req(f"g#{i}", [1, 2, 3], max_tokens=2) for i in range(3)]
    sched.add_request(kids[0], kids[1:])
    sched.abort_request("g#0")
    sched.abort_request("g#2")
    out, _ = _step(sched, {})
    assert [(s.request_id, s.fork_ids) for s in out.scheduled] == [("g#1", [])]
    assert kids[0].finish_reason == kids[2].finish_reason == "abort"


class ShadowRunner:
    """Plays the model runner: copies blocks as asked, writes each scheduled token's id into its
    slot and checks that every position a request attends to holds that request's token."""

    def __init__(self, num_blocks, block_size):
        self.slots = [None] * (num_blocks * block_size)
        self.bs = block_size

    def run(self, out, requests):
        bs = self.bs
        for src, dst in out.blocks_to_copy:
            self.slots[dst * bs:(dst + 1) * bs] = self.slots[src * bs:(src + 1) * bs]
        for s in out.scheduled:
            for i, tok in enumerate(s.token_ids):
                pos = s.start_pos + i
                self.slots[s.block_ids[pos // bs] * bs + pos % bs] = tok
        for s in out.scheduled:
            seq = requests[s.request_id].all_token_ids + requests[s.request_id].spec_token_ids
            for pos in range(s.start_pos + len(s.token_ids)):
                got = self.slots[s.block_ids[pos // bs] * bs + pos % bs]
                assert got == seq[pos], f"{s.request_id}: position {pos} holds {got}, expected {seq[pos]}"


@pytest.mark.parametrize("policy,block_size,num_blocks,budget,caching", [
    ("fcfs", 4, 24, 16, True), ("fcfs", 1, 90, 7, True), ("priority", 4, 20, 32, True), ("fcfs", 4, 24, 10_000, False),
    ("fcfs", 3, 40, 24, False),
])
def test_random_workload_keeps_invariants(policy, block_size, num_blocks, budget, caching):
    """Prefix sharing, n > 1 forks, drafts (some right), aborts and preemption; every step's
    attended positions hold the right tokens and the pool stays consistent."""
    rng = random.Random(block_size * 1000 + num_blocks)
    kv = KVCacheManager(num_blocks, block_size, caching)
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=64, policy=policy)
    shadow = ShadowRunner(num_blocks, block_size)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(0, 20))] for _ in range(3)]
    everything = {}
    for i in range(40):
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 25))]
        n = rng.choice([1, 1, 1, 2, 3])
        group = [_req(f"r{i}#{j}", tokens, rng.randint(1, 20), priority=rng.randint(0, 3), arrival=float(i))
                 for j in range(n)]
        sched.add_request(group[0], group[1:])
        everything.update((r.request_id, r) for r in group)
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 5000
        for r in sched.running:
            if r.num_computed_tokens == r.num_tokens - 1 and rng.random() < 0.3:
                r.spec_token_ids = [rng.randrange(50) for _ in range(rng.randint(1, 3))]
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        shadow.run(out, sched.requests)
        sampled = {}
        for s in out.scheduled:
            if s.num_logits:
                drafts = s.spec_token_ids
                toks = [d if rng.random() < 0.5 else rng.randrange(50) for d in drafts] + [rng.randrange(50)]
                sampled[s.request_id] = SampledTokens(toks)
                for f in s.fork_ids:
                    sampled[f] = SampledTokens([rng.randrange(50)])
        sched.update_from_output(out, sampled)
        if rng.random() < 0.03 and sched.running:
            sched.abort_request(rng.choice(sched.running).request_id)
        kv.pool.check_invariants()
    assert kv.num_free_blocks == num_blocks and not kv.req_blocks and not kv.copies and not sched.requests
    finished = [r for r in everything.values() if r.status == RequestStatus.FINISHED_LENGTH]
    assert all(r.num_output_tokens == r.max_tokens for r in finished) and len(finished) > 40
    if caching:
        assert kv.stats.hits > 0
    if num_blocks <= 24:
        assert sched.num_preemptions > 0
