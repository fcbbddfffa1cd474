"""kivi2 in the engine: with a residual window covering the whole context it is the float cache,
token for token; the quantized pages hold KIVI's codes of transformers' own keys and values; n > 1
samples fork exactly; a small pool preempts and gives every block back."""

from __future__ import annotations

import pytest
import torch

from llmopt.core.sampling_params import SamplingParams
from llmopt.kernels import kivi

from engine_helpers import mixed_prompts, run_engine

G, R = 16, 32


@pytest.fixture(scope="module")
def model(tiny_factory):
    return tiny_factory(weight_std=0.2, max_position_embeddings=1024, head_dim=32, hidden_size=128)


def _engine(path, kv="kivi2", memory=16 << 20, **kw):
    from llmopt.engine.args import EngineArgs
    from llmopt.engine.engine import LLMEngine
    from llmopt.models.loader import load_model
    args = dict(model=str(path), dtype="float32", device="cpu", detokenize=False, kv_cache_memory=memory,
                kv_cache_dtype=kv, max_num_batched_tokens=64, max_model_len=512)
    if kv == "kivi2":
        args |= dict(kivi_group_size=G, kivi_residual_length=R)
    return LLMEngine(EngineArgs(**(args | kw)), loaded=load_model(str(path), "float32", "cpu", tokenizer=False))


def _no_leak(engine):
    kv = engine.kv
    kv.pool.check_invariants()
    kv.kivi.pool.check_invariants()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and kv.kivi.pool.num_free_blocks == kv.kivi.pool.num_blocks
    assert not kv.req_blocks and not kv.kivi.blocks


GREEDY = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


def test_a_residual_window_over_the_whole_context_is_the_float_cache(model):
    prompts = mixed_prompts(5, 96, 10, 150, seed=3)
    want = run_engine(_engine(model, "float32"), prompts, GREEDY)
    engine = _engine(model, kivi_residual_length=512)
    assert run_engine(engine, prompts, GREEDY) == want
    _no_leak(engine)


def test_quantized_pages_hold_kivis_codes_of_transformers_keys_and_values(model):
    """A 100-token prompt in one chunk: the K/V rows of its first (100 - R) // G groups, quantized at
    the next step, are KIVI's codes of transformers' own K and V (after RoPE) within one code step."""
    from engine_helpers import hf_model
    hf = hf_model(model)
    prompt = mixed_prompts(1, 96, 100, 100, seed=5)[0]
    engine = _engine(model, max_num_batched_tokens=128)
    engine.add_request("a", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()                              # converts the groups pushed out of the last R tokens
    q = engine.kv.num_quantized_blocks("a")
    assert q == (100 - R) // G
    pages = torch.tensor(engine.kv.get_block_ids("a")[:q])
    with torch.no_grad():
        past = hf(torch.tensor([prompt]), use_cache=True).past_key_values
    r = engine.runner
    for layer in range(r.num_layers):
        k_hf, v_hf = (t[0].transpose(0, 1) for t in (past.layers[layer].keys, past.layers[layer].values))   # [T, Hkv, D]
        k_hf = k_hf[:q * G].reshape(q, G, *k_hf.shape[1:])
        v_hf = v_hf[:q * G].reshape(q, G, *v_hf.shape[1:])
        k = kivi.dequantize_keys(r.key_pages[layer][pages], G, 32, torch.float64)
        v = kivi.dequantize_values(r.value_pages[layer][pages], G, 32, torch.float64)
        k_step = (k_hf.amax(1, keepdim=True) - k_hf.amin(1, keepdim=True)).double() / 3     # per channel
        vg = v_hf.reshape(q, G, -1, 32 // min(G, 32), min(G, 32)).double()
        v_step = ((vg.amax(-1, keepdim=True) - vg.amin(-1, keepdim=True)) / 3).expand_as(vg).reshape(v.shape)
        assert ((k - k_hf.double()).abs() <= k_step * 0.5 + 1e-3).all()
        assert ((v - v_hf.double()).abs() <= v_step * 0.5 + 1e-3).all()
        assert ((k - k_hf.double()).abs() > 1e-3).any()          # really 2-bit, not a copy
    while engine.has_unfinished_requests():
        engine.step()
    _no_leak(engine)


def test_n_samples_fork_the_quantized_blocks_and_copy_the_residual(model):
    prompt = mixed_prompts(1, 96, 90, 90, seed=7)[0]
    alone = run_engine(_engine(model), [prompt], GREEDY)[0]
    engine = _engine(model)
    engine.add_request("p", prompt, SamplingParams(n=3, max_tokens=60, temperature=0.0, ignore_eos=True))
    done = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done = o
    assert [c.token_ids for c in done.outputs] == [alone] * 3
    _no_leak(engine)


def test_a_small_pool_preempts_and_every_block_comes_back(model):
    prompts = mixed_prompts(8, 96, 40, 120, seed=9)
    engine = _engine(model, memory=250_000, max_model_len=200)
    got = run_engine(engine, prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [len(g) for g in got] == [60] * 8
    _no_leak(engine)


def test_kivi_flags_are_refused_where_they_do_not_apply(model):
    from llmopt.engine.args import EngineArgs
    from llmopt.errors import UserInputError
    with pytest.raises(UserInputError, match="kivi2 only"):
        EngineArgs(model=str(model), kv_cache_dtype="float32", kivi_group_size=16)
    with pytest.raises(UserInputError, match="multiple of the group size"):
        _engine(model, kivi_residual_length=24)
    with pytest.raises(UserInputError, match="tensor-parallel-size 1"):
        EngineArgs(model=str(model), kv_cache_dtype="kivi2", tensor_parallel_size=2)
    engine = _engine(model, max_num_batched_tokens=0)        # unlimited: a step writes at most a context
    assert engine.kv.kivi.pool.num_blocks < 1000
    with pytest.raises(UserInputError, match="speculative"):
        EngineArgs(model=str(model), kv_cache_dtype="kivi2", speculative_config={"method": "ngram",
                                                                                   "num_speculative_tokens": 2})


def test_quantized_blocks_evicted_to_the_tier_come_back_with_the_same_logits(model):
    """Only quantized blocks are cached: a prompt's pages evicted from a 16-block pool are found in
    the offload tier, loaded back, and give the logits the pool's own hit gave."""
    from llmopt.worker.offload import HASH_BYTES
    engine = _engine(model, memory=212_992, max_model_len=160, kv_offload_bytes=64 * (2048 + HASH_BYTES))
    assert (engine.kv.pool.num_blocks, engine.kv.kivi.pool.num_blocks) == (16, 11)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)

    def run(prompts):
        from engine_helpers import run_outputs
        return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
                for o in run_outputs(engine, prompts, sp)]

    p = mixed_prompts(1, 96, 100, 100, seed=11)[0]
    run([p])
    hits = engine.stats().prefix_cache_hits
    want = run([p])                                          # 4 quantized blocks from the pool
    assert engine.stats().prefix_cache_hits - hits == 4 * G
    for seed in (12, 13, 14):
        run(mixed_prompts(1, 96, 150, 150, seed=seed))         # their pages evict p's
    got = run([p])
    s = engine.stats()
    assert s.kv_offload_hit_tokens == 4 * G and s.kv_offload_loaded_bytes == 4 * 2048
    assert got == want
    _no_leak(engine)


def test_a_failed_conversion_stops_the_engine_rather_than_serve_unwritten_pages(model, monkeypatch):
    from llmopt.errors import EngineDeadError
    engine = _engine(model)
    engine.add_request("a", mixed_prompts(1, 96, 100, 100, seed=2)[0], GREEDY)
    engine.step()

    def fail(copies, converts):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine.runner, "kivi_work", fail)
    with pytest.raises(EngineDeadError, match="KV-cache transfers failed"):
        while engine.has_unfinished_requests():
            engine.step()
