"""The batched engine on a tiny random Llama against transformers' greedy generate, one prompt at a
time: token for token, with prefix caching on and off, a KV budget small enough to preempt,
chunked-prefill budgets 8, 64 and unlimited, and block sizes 1 and 16. Plus aborts, seeds, n > 1,
stop conditions, and the KV-cache accounting."""

import asyncio
import logging

import pytest
import torch

from engine_util import hf_greedy, hf_model, mixed_prompts, save_tiny_llama
from llmopt.engine.args import EngineArgs
from llmopt.engine.async_engine import AsyncLLMEngine
from llmopt.engine.engine import LLMEngine
from llmopt.engine.llm import LLM
from llmopt.engine.sampling_params import SamplingParams
from llmopt.errors import UserInputError
from llmopt.models.loader import load_model

N_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    loaded = load_model(str(path), "float32", "cpu", tokenizer=False)
    prompts = mixed_prompts(16, 96, lo=1, hi=60, shared_prefix=20)
    prompts[3] = prompts[3][:5]  # a short one: prefix caching must leave at least one token to compute
    return path, loaded, prompts, hf_greedy(hf_model(path), prompts, N_NEW)


def run_engine(engine: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    ids = [engine.add_request(f"p{i}", p, params) for i, p in enumerate(prompts)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i].outputs[0].token_ids for i in ids]


def check_no_leak(engine: LLMEngine) -> None:
    pool = engine.kv.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks and not engine.kv.req_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


# 2 layers * 2 (K, V) * 2 kv heads * 16 head dim * 4 bytes = 256 bytes per token
SMALL_KV = 256 * 16 * 14  # 14 blocks of 16 tokens: far fewer than 16 prompts need at once


@pytest.mark.parametrize("kw", [
    dict(),
    dict(enable_prefix_caching=False),
    dict(kv_cache_memory=SMALL_KV, max_model_len=96),
    dict(max_num_batched_tokens=8),
    dict(max_num_batched_tokens=64),
    dict(max_num_batched_tokens=None, enable_prefix_caching=False),
    dict(block_size=1),
    dict(block_size=16, max_num_seqs=5),
], ids=["default", "no-prefix-cache", "preempt", "chunk8", "chunk64", "unlimited", "block1", "block16-seqs5"])
def test_greedy_matches_transformers(tiny, kw):
    path, loaded, prompts, ref = tiny
    kw.setdefault("kv_cache_memory", 1 << 22)
    engine = LLMEngine(EngineArgs(model=str(path), detokenize=False, **kw), loaded=loaded)
    assert run_engine(engine, prompts) == ref
    check_no_leak(engine)
    stats = engine.stats()
    if engine.args.enable_prefix_caching:
        assert stats.prefix_cache_hits > 0
    else:
        assert stats.prefix_cache_hits == 0
    if kw["kv_cache_memory"] == SMALL_KV:
        assert stats.num_preemptions > 0


def test_abort_frees_every_block(tiny):
    path, loaded, prompts, ref = tiny
    engine = LLMEngine(EngineArgs(model=str(path), detokenize=False, kv_cache_memory=1 << 22, max_num_seqs=4,
                                  max_num_batched_tokens=32), loaded=loaded)
    for i, p in enumerate(prompts[:8]):
        engine.add_request(f"p{i}", p, GREEDY)
    engine.step()
    engine.step()
    engine.abort_request(["p0", "p7"])  # one running, one still waiting
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert sorted(done) == [f"p{i}" for i in range(1, 7)]
    assert [done[f"p{i}"].outputs[0].token_ids for i in range(1, 7)] == ref[1:7]
    check_no_leak(engine)


def test_seeded_sampling_is_reproducible_and_n_shares_the_prompt(tiny):
    path, loaded, prompts, _ = tiny
    engine = LLMEngine(EngineArgs(model=str(path), detokenize=False, kv_cache_memory=1 << 22), loaded=loaded)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, ignore_eos=True, seed=7)
    alone = run_engine(engine, [prompts[0]], params)
    crowd = run_engine(engine, prompts[:6], params)
    assert crowd[0] == alone[0]
    hits_before = engine.stats().prefix_cache_hits
    engine.add_request("multi", prompts[1], SamplingParams(n=3, temperature=1.0, max_tokens=10, ignore_eos=True, seed=3))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1
    assert engine.stats().prefix_cache_hits - hits_before >= 2 * (len(prompts[1]) // 16) * 16
    check_no_leak(engine)


def test_n_samples_share_prompt_blocks_without_prefix_caching(tiny):
    path, loaded, prompts, ref = tiny
    engine = LLMEngine(EngineArgs(model=str(path), detokenize=False, kv_cache_memory=1 << 22, block_size=4,
                                  enable_prefix_caching=False), loaded=loaded)
    prompt = prompts[1]
    engine.add_request("multi", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=N_NEW, ignore_eos=True))
    engine.add_request("other", prompt, GREEDY)  # same tokens, not a sibling: no sharing with caching off
    engine.step()
    tables = [engine.kv.get_block_ids(f"multi#{i}") for i in range(3)]
    full = (len(prompt) - 1) // 4
    assert full >= 2 and tables[0][:full] == tables[1][:full] == tables[2][:full]
    assert not set(engine.kv.get_block_ids("other")) & set(tables[0])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert [c.token_ids for c in done["multi"].outputs] == [ref[1]] * 3 and done["other"].outputs[0].token_ids == ref[1]
    assert engine.stats().prefix_cache_hits == 0
    check_no_leak(engine)


def test_stop_token_ids_min_tokens_and_max_tokens(tiny):
    path, loaded, prompts, ref = tiny
    engine = LLMEngine(EngineArgs(model=str(path), detokenize=False, kv_cache_memory=1 << 22), loaded=loaded)
    target = ref[0][3]
    first = ref[0].index(target)
    out = run_engine(engine, [prompts[0]], SamplingParams(temperature=0, max_tokens=N_NEW, stop_token_ids=[target]))
    assert out[0] == ref[0][:first + 1]
    out = run_engine(engine, [prompts[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert out[0] == ref[0][:3]
    out = run_engine(engine, [prompts[0]], SamplingParams(temperature=0, max_tokens=N_NEW, min_tokens=N_NEW,
                                                          stop_token_ids=[target]))
    assert len(out[0]) == N_NEW and target not in out[0]  # blocked while min_tokens are not out
    with pytest.raises(UserInputError):
        engine.add_request("long", list(range(600)), GREEDY)
    check_no_leak(engine)


@pytest.mark.parametrize("kv_dtype,elem", [("auto", 4), ("int8", 1), ("fp8", 1)])
def test_kv_cache_info_matches_allocated_tensors(tiny, kv_dtype, elem, caplog):
    path, loaded, prompts, _ = tiny
    budget = 300_000
    with caplog.at_level(logging.INFO, logger="llmopt.engine"):
        engine = LLMEngine(EngineArgs(model=str(path), detokenize=False, kv_cache_memory=budget, block_size=8,
                                      kv_cache_dtype=kv_dtype, max_model_len=128), loaded=loaded)
    info = engine.kv_cache_info()
    per_block = 2 * 8 * 2 * 16 * elem + (2 * 8 * 2 * 4 if kv_dtype == "int8" else 0)
    assert info.bytes_per_block == per_block and info.num_layers == 2 and info.block_size == 8
    assert info.num_blocks == budget // (2 * per_block)
    r = engine.runner
    tensors = r.key_caches + r.value_caches + r.k_scale_caches + r.v_scale_caches
    assert len(tensors) == (8 if kv_dtype == "int8" else 4)
    assert info.bytes_allocated == sum(t.nbytes for t in tensors) == info.num_blocks * 2 * per_block
    assert f"{info.num_blocks} blocks" in caplog.text and "Maximum concurrency for 128 tokens" in caplog.text
    out = run_engine(engine, prompts[:4])
    assert all(len(o) == N_NEW for o in out)
    check_no_leak(engine)


def test_llm_generate_and_async_stream_agree(tiny):
    path, loaded, prompts, ref = tiny
    llm = LLM(str(path), loaded=loaded, detokenize=False, kv_cache_memory=1 << 22)
    outs = llm.generate(prompts[:4], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref[:4]

    async def main():
        engine = AsyncLLMEngine(llm.engine)

        async def consume(i):
            seen = []
            async for out in engine.generate(prompts[i], GREEDY, request_id=f"a{i}"):
                seen.append(list(out.outputs[0].token_ids))
            return seen

        async def abandon():  # a long request whose consumer leaves after two outputs
            gen = engine.generate(prompts[2], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
            seen = [await gen.__anext__(), await gen.__anext__()]
            await gen.aclose()
            return seen

        results = await asyncio.gather(consume(0), consume(1), abandon())
        for _ in range(100):
            if not llm.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        return results

    s0, s1, s2 = asyncio.run(main())
    assert s0[-1] == ref[0] and s1[-1] == ref[1] and len(s0) == N_NEW
    assert all(s0[k] == ref[0][:k + 1] for k in range(N_NEW))  # one more token per streamed output
    assert len(s2) == 2 and not s2[-1].finished and not llm.engine.has_unfinished_requests()
    check_no_leak(llm.engine)


@pytest.mark.parametrize("kind", ["oracle", "wrong", "half"])
def test_draft_tokens_are_verified_in_one_forward(tiny, kind):
    """A drafter proposes k tokens; the engine verifies them in the same forward (several logits rows
    per request). Right drafts save steps, wrong ones are rejected: the output never changes."""
    path, loaded, prompts, ref = tiny
    engine = LLMEngine(EngineArgs(model=str(path), detokenize=False, kv_cache_memory=1 << 22, block_size=4),
                       loaded=loaded)
    index = {f"p{i}": i for i in range(len(prompts))}

    def drafter(reqs):
        out = {}
        for r in reqs:
            want = ref[index[r.request_id]][r.num_output_tokens:r.num_output_tokens + 3]
            if kind == "wrong":
                want = [(t + 1) % 96 for t in want]
            elif kind == "half":
                want = want[:1] + [(t + 1) % 96 for t in want[1:]]
            out[r.request_id] = want
        return out

    engine.drafter = drafter
    steps = 0
    ids = [engine.add_request(f"p{i}", p, GREEDY) for i, p in enumerate(prompts[:6])]
    done = {}
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[i] for i in ids] == ref[:6]
    if kind == "oracle":
        assert steps <= 3  # prefill + 8 tokens at up to 4 per step
    elif kind == "wrong":
        assert steps == N_NEW
    check_no_leak(engine)
