"""The KV cache's second tier (--kv-offload-bytes, --kv-offload-dir): prefix blocks evicted from
the pool are found there and copied back with the bytes they had, a restart finds a disk tier's
blocks, a preempted request resumes from it, and every block and pin is returned."""

from __future__ import annotations

import pytest
import torch

from llmopt.cache.offload import OffloadIndex
from llmopt.core.sampling_params import SamplingParams
from llmopt.errors import UserInputError

BLOCK = 16


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory(weight_std=0.2, max_position_embeddings=1024)


def _engine(path, blocks: int, tier_blocks: int | None, directory=None, kv_cache_dtype="float32", **kw):
    from llmopt.engine.args import EngineArgs
    from llmopt.engine.engine import LLMEngine
    from llmopt.kernels import kv_block_bytes
    from llmopt.models.loader import load_model
    loaded = load_model(str(path), "float32", "cpu", tokenizer=False)
    cfg = loaded.config
    per = cfg.num_hidden_layers * kv_block_bytes(BLOCK, cfg.num_key_value_heads, cfg.head_dim, kv_cache_dtype,
                                                 torch.float32)
    args = EngineArgs(model=str(path), dtype="float32", device="cpu", detokenize=False, block_size=BLOCK,
                      kv_cache_memory=blocks * per, kv_cache_dtype=kv_cache_dtype, max_model_len=160,
                      kv_offload_bytes=None if tier_blocks is None else tier_blocks * per, kv_offload_dir=directory,
                      **kw)
    return LLMEngine(args, loaded=loaded)


def _run(engine, prompts, max_tokens=4):
    """Greedy tokens and their logprobs per prompt, all added at once."""
    from engine_helpers import run_outputs
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in run_outputs(engine, prompts, sp)]
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


def _prompt(n, seed):
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _idle(engine):
    """Nothing held, nothing pending: every block back in the pool, no pin or transfer left."""
    kv = engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    kv.pool.check_invariants()
    assert kv.offload.saves == [] and kv.offload.loads == [] and not kv.offload._pinned
    assert len(kv.offload) <= kv.offload.num_slots


def test_an_evicted_prefix_comes_back_from_the_tier_with_its_bytes(tiny):
    engine = _engine(tiny, 12, 64)
    p = _prompt(70, 1)
    _run(engine, [p])
    want = _run(engine, [p])                        # its 4 full blocks from the pool
    ids = engine.kv.block_hashes(type("R", (), {"request_id": "x", "all_token_ids": p})())[:4]
    held = {h: engine.kv.pool.get_cached_block(h).block_id for h in ids}
    before = {h: torch.cat([t[b].flatten().view(torch.uint8) for t in engine.runner._kv_tensors()])
              for h, b in held.items()}
    hits0 = engine.stats().prefix_cache_hits
    _run(engine, [_prompt(150, 2), _prompt(150, 3)])   # evicts p's blocks from the pool
    assert all(engine.kv.pool.get_cached_block(h) is None for h in ids)
    s = engine.stats()
    assert s.kv_offload_saved_bytes >= 4 * engine.kv.offload.block_bytes
    got = _run(engine, [p])
    s2 = engine.stats()
    assert got == want
    assert s2.kv_offload_hit_tokens == 64 and s2.kv_offload_loaded_bytes == 4 * engine.kv.offload.block_bytes
    assert s2.prefix_cache_hits - hits0 >= 64
    for h in ids:   # the blocks loaded back hold the bytes the pool held
        b = engine.kv.pool.get_cached_block(h).block_id
        assert torch.equal(torch.cat([t[b].flatten().view(torch.uint8) for t in engine.runner._kv_tensors()]), before[h])
    _idle(engine)


def test_a_disk_tier_is_found_after_a_restart(tiny, tmp_path):
    p = _prompt(70, 5)
    first = _engine(tiny, 12, 32, str(tmp_path))
    _run(first, [p])
    want = _run(first, [p])
    _run(first, [_prompt(150, 6), _prompt(150, 7)])       # p's blocks go to the file
    assert first.stats().kv_offload_saved_bytes > 0
    with pytest.raises(UserInputError, match="another process holds the KV offload file"):
        _engine(tiny, 12, 32, str(tmp_path))          # the file is locked while `first` runs
    first.shutdown()
    again = _engine(tiny, 12, 32, str(tmp_path))
    assert len(again.kv.offload) > 0                      # rebuilt from the slots' hashes
    assert _run(again, [p]) == want and again.stats().kv_offload_hit_tokens == 64
    _idle(again)
    again.shutdown()
    other = _engine(tiny, 12, 32, str(tmp_path), kv_cache_dtype="bfloat16")   # another layout: its own file
    assert len(other.kv.offload) == 0 and len(list(tmp_path.iterdir())) == 2


def test_a_torn_slot_is_never_found(tiny, tmp_path):
    """A slot whose hash was cleared (a save that did not finish) is not restored."""
    e = _engine(tiny, 12, 32, str(tmp_path))
    _run(e, [_prompt(70, 8)])
    _run(e, [_prompt(150, 9), _prompt(150, 10)])
    store = e.runner.offload
    held = store.restored()
    assert held
    store.hashes[held[0][1]] = 0
    e.shutdown()
    again = _engine(tiny, 12, 32, str(tmp_path))
    assert len(again.kv.offload) == len(held) - 1


def test_preempted_requests_resume_from_the_tier_with_their_greedy_tokens(tiny):
    """Six requests over a pool too small for them all: preemption frees their blocks, which the
    tier keeps; each finishes with the tokens it generates alone, and the tier served hits."""
    prompts = [_prompt(40 + 7 * i, 20 + i) for i in range(6)]
    alone = [_run(_engine(tiny, 64, None), [p], 40)[0] for p in prompts]
    engine = _engine(tiny, 14, 64)
    got = _run(engine, prompts, 40)
    assert engine.scheduler.num_preemptions > 0 and engine.stats().kv_offload_hit_tokens > 0
    assert [g[0] for g in got] == [a[0] for a in alone]
    _idle(engine)


def test_offload_index_lru_and_pins():
    ix = OffloadIndex(2, 100)
    ix.plan_save(5, b"a")
    ix.plan_save(6, b"b")
    ix.plan_save(7, b"c")                   # both slots pinned (saved this step): nothing planned
    assert [s[2] for s in ix.saves] == [b"a", b"b"]
    ix.take_transfers()
    assert ix.lookup(b"a") is not None      # a is now the most recently used
    ix.plan_save(7, b"c")                   # evicts b
    assert ix.lookup(b"b") is None and ix.lookup(b"c") is not None
    ix.pin([ix.lookup(b"a")])
    ix.take_transfers()
    ix.pin([ix.lookup(b"a"), ix.lookup(b"c")])
    ix.plan_save(8, b"d")                   # every slot pinned by planned loads: not saved
    assert ix.lookup(b"d") is None
    assert ix.stats.saved_bytes == 300


def test_offload_flags_are_checked(tiny, tmp_path):
    from llmopt.engine.args import EngineArgs
    with pytest.raises(UserInputError, match="needs --kv-offload-bytes"):
        EngineArgs(model="x", kv_offload_dir=str(tmp_path))
    with pytest.raises(UserInputError, match="needs prefix caching"):
        EngineArgs(model="x", kv_offload_bytes=1 << 20, enable_prefix_caching=False)
    with pytest.raises(UserInputError, match="no such folder"):
        EngineArgs(model="x", kv_offload_bytes=1 << 20, kv_offload_dir=str(tmp_path / "missing"))
    with pytest.raises(UserInputError, match="holds no block"):
        _engine(tiny, 12, 0.5)


def test_metrics_expose_the_tier_counters(tiny):
    """/metrics' engine collector carries the tier's counters as counters (llmopt:kv_offload_*)."""
    from llmopt.serve.metrics import PREFIX, _EngineCollector
    engine = _engine(tiny, 12, 64)
    p = _prompt(70, 11)
    _run(engine, [p])
    _run(engine, [_prompt(150, 12), _prompt(150, 13)])
    _run(engine, [p])
    s = engine.stats()
    assert s.kv_offload_hit_tokens == 64 and s.kv_offload_saved_bytes > 0
    got = {m.name: (m.type, m.samples[0].value) for m in _EngineCollector(engine.stats, {"engine": "0"}).collect()}
    for name in ("kv_offload_hit_tokens", "kv_offload_saved_bytes", "kv_offload_loaded_bytes"):
        assert got[PREFIX + name] == ("counter", float(getattr(s, name)))


def test_a_prefix_cache_reset_empties_the_tier(tiny):
    engine = _engine(tiny, 12, 64)
    p = _prompt(70, 14)
    _run(engine, [p])
    _run(engine, [_prompt(150, 15), _prompt(150, 16)])
    assert len(engine.kv.offload) > 0
    assert engine.reset_prefix_cache()
    assert len(engine.kv.offload) == 0
    _run(engine, [p])
    assert engine.stats().kv_offload_hit_tokens == 0
