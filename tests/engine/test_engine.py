"""The batched engine on a tiny random Llama against transformers' greedy generate, one prompt at a
time: token for token, with prefix caching on and off, a KV budget small enough to preempt,
chunked-prefill budgets 8, 64 and unlimited, and block sizes 1 and 16. Plus aborts, seeds, n > 1
(copy-on-write fork of the prompt), stop conditions, metrics, the prefix-cache hit rate and reset,
two engines with different kernel backends in one process, and the KV-cache accounting."""

import asyncio
import logging

import pytest

from engine_helpers import check_no_leak, hf_greedy, hf_model, mixed_prompts, run_engine, run_outputs
from llmopt.engine.args import EngineArgs
from llmopt.engine.async_engine import AsyncLLMEngine
from llmopt.engine.engine import LLMEngine
from llmopt.engine.llm import LLM
from llmopt.speculative.interface import DraftProposal, ProposeInput, Proposer
from llmopt.core.sampling_params import SamplingParams
from llmopt.errors import UserInputError
from llmopt.speculative.config import SpeculativeConfig
from llmopt.models.loader import load_model

N_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    path = tiny_llama
    loaded = load_model(str(path), "float32", "cpu", tokenizer=False)
    prompts = mixed_prompts(16, 96, lo=1, hi=60, shared_prefix=20)
    prompts[3] = prompts[3][:5]  # a short one: prefix caching must leave at least one token to compute
    return path, loaded, prompts, hf_greedy(hf_model(path), prompts, N_NEW)


# 2 layers * 2 (K, V) * 2 kv heads * 16 head dim * 4 bytes = 256 bytes per token
SMALL_KV = 256 * 16 * 14  # 14 blocks of 16 tokens: far fewer than 16 prompts need at once


def test_token_budget_defaults_by_device_and_reaches_the_scheduler(tiny):
    """--max-num-batched-tokens: 256 on the CPU, 2048 on a GPU when not given; 0 is unlimited; a
    given value is kept; the scheduler spends what EngineArgs holds."""
    path, loaded, _, _ = tiny
    assert EngineArgs(device="cpu").max_num_batched_tokens == 256
    assert EngineArgs(device="cuda").max_num_batched_tokens == 2048
    assert EngineArgs(device="cpu", max_num_batched_tokens=0).max_num_batched_tokens >= 1 << 31
    assert EngineArgs(device="cpu", max_num_batched_tokens=100).max_num_batched_tokens == 100
    engine = LLMEngine(EngineArgs(model=str(path), detokenize=False, kv_cache_memory=1 << 22), loaded=loaded)
    assert engine.scheduler.max_num_batched_tokens == 256


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
    assert run_engine(engine, prompts, GREEDY) == ref
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


def test_seeded_sampling_is_reproducible(tiny):
    path, loaded, prompts, _ = tiny
    engine = LLMEngine(EngineArgs(model=str(path), detokenize=False, kv_cache_memory=1 << 22), loaded=loaded)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, ignore_eos=True, seed=7)
    alone = run_engine(engine, [prompts[0]], params)
    crowd = run_engine(engine, prompts[:6], params)
    assert crowd[0] == alone[0]
    check_no_leak(engine)


@pytest.mark.parametrize("caching", [True, False])
def test_n_samples_fork_the_prompt_copy_on_write(tiny, caching):
    """n > 1: the prompt is computed once; the samples share all its blocks, the partial last one
    included, and each copies that block before writing into it (the last one writes in place).
    Their tokens equal those of n separate requests with seeds seed + i."""
    path, loaded, prompts, ref = tiny
    bs, n = 4, 3
    prompt = prompts[1]
    assert len(prompt) % bs and len(prompt) > 2 * bs
    engine = LLMEngine(EngineArgs(model=str(path), detokenize=False, kv_cache_memory=1 << 22, block_size=bs,
                                  enable_prefix_caching=caching), loaded=loaded)
    copies = []
    real_copy = engine.runner.copy_blocks
    engine.runner.copy_blocks = lambda pairs: copies.extend(pairs) or real_copy(pairs)
    sampled = SamplingParams(n=n, temperature=1.0, max_tokens=N_NEW, ignore_eos=True, seed=11)
    engine.add_request("multi", prompt, sampled)
    engine.step()                                   # the prompt, once; the n samples fork from it
    prompt_blocks = -(-len(prompt) // bs)
    tables = [engine.kv.get_block_ids(f"multi#{i}") for i in range(n)]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == prompt_blocks
    assert engine.kv.pool.usage() * engine.kv.pool.num_blocks == prompt_blocks
    assert copies == []
    engine.step()                                   # each sample writes its first output token
    used = round(engine.kv.pool.usage() * engine.kv.pool.num_blocks)
    assert used == prompt_blocks + n - 1            # not n * prompt_blocks
    tables = [engine.kv.get_block_ids(f"multi#{i}") for i in range(n)]
    assert all(t[:-1] == tables[0][:-1] for t in tables) and len({t[-1] for t in tables}) == n
    assert len(copies) == n - 1 and all(src == tables[-1][-1] for src, _ in copies)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    forked = [c.token_ids for c in done["multi"].outputs]
    check_no_leak(engine)
    import dataclasses
    separate = [run_engine(engine, [prompt], dataclasses.replace(sampled, n=1, seed=11 + i))[0] for i in range(n)]
    assert forked == separate and len({tuple(t) for t in forked}) > 1
    greedy = run_outputs(engine, [prompt], dataclasses.replace(GREEDY, n=n))[0]
    assert [c.token_ids for c in greedy.outputs] == [ref[1]] * n
    check_no_leak(engine)


def test_forked_samples_free_their_blocks_on_abort_and_preemption(tiny):
    path, loaded, prompts, ref = tiny
    # 2 layers * 2 (K, V) * 2 heads * 16 dims * 4 bytes * 4 tokens = 2 KiB per block: 40 blocks, fewer
    # than the 2 * (4 shared + 3 * 8) that the two prompts' samples reach
    engine = LLMEngine(EngineArgs(model=str(path), detokenize=False, kv_cache_memory=40 * 2048, block_size=4,
                                  max_model_len=64), loaded=loaded)
    assert engine.kv.pool.num_blocks == 40
    params = SamplingParams(n=3, temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", prompts[1][:18], params)
    engine.add_request("b", prompts[2][:18], params)
    engine.add_request("c", prompts[4][:9], SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()
    engine.abort_request("c")                       # its samples forked in the first step
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert engine.stats().num_preemptions > 0 and sorted(done) == ["a", "b"]
    hf = hf_greedy(hf_model(path), [prompts[1][:18], prompts[2][:18]], 30)
    assert [c.token_ids for c in done["a"].outputs] == [hf[0]] * 3
    assert [c.token_ids for c in done["b"].outputs] == [hf[1]] * 3
    check_no_leak(engine)
    engine.add_request("d", prompts[3], params)     # aborted before its prompt ran: siblings never forked
    engine.abort_request("d")
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    check_no_leak(engine)


def test_metrics_prefix_cache_hit_rate_and_reset(tiny):
    path, loaded, prompts, ref = tiny
    engine = LLMEngine(EngineArgs(model=str(path), detokenize=False, kv_cache_memory=1 << 22), loaded=loaded)
    before = __import__("time").monotonic()
    outs = run_outputs(engine, prompts[:3], GREEDY)
    for o in outs:
        m = o.metrics
        assert before <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.time_in_queue >= 0 and 0 < m.time_to_first_token <= m.e2e_latency
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0  # the shared 20-token prefix
    assert stats.prefix_cache_hit_rate == stats.prefix_cache_hits / stats.prefix_cache_queries
    engine.add_request("busy", prompts[0], GREEDY)
    engine.step()
    assert engine.reset_prefix_cache() is False      # blocks in use: refused
    engine.abort_request("busy")
    hits = engine.stats().prefix_cache_hits
    assert run_engine(engine, [prompts[0]], GREEDY) == [ref[0]]
    assert engine.stats().prefix_cache_hits > hits   # served from the cache
    assert engine.reset_prefix_cache() is True
    hits = engine.stats().prefix_cache_hits
    assert run_engine(engine, [prompts[0]], GREEDY) == [ref[0]]
    assert engine.stats().prefix_cache_hits == hits  # nothing left to hit
    check_no_leak(engine)


def test_two_engines_with_different_backends_in_one_process(tiny, monkeypatch):
    """The kernel backend belongs to each engine's runner: a torch and a triton engine (Triton's
    interpreter on the CPU) step interleaved and agree; each really ran its own kernels."""
    from llmopt.kernels import reference, triton_attention, triton_kv
    path, loaded, prompts, ref = tiny
    calls = {"triton": 0, "torch": 0}
    for mod, name, key in ((triton_attention, "paged_attention", "triton"), (triton_kv, "write_kv", "triton"),
                           (reference, "paged_attention", "torch"), (reference, "write_kv", "torch")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _k=key, **kw: calls.__setitem__(_k, calls[_k] + 1) or _r(*a, **kw))
    engines = {b: LLMEngine(EngineArgs(model=str(path), detokenize=False, kv_cache_memory=1 << 20, block_size=8,
                                       attention_backend=b), loaded=loaded) for b in ("torch", "triton")}
    assert engines["torch"].runner.backend == "torch" and engines["triton"].runner.backend == "triton"
    engines["torch"].runner.cpu_decode = None   # decode steps through the backend's kernels (not the C++ layers)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for b, e in engines.items():
        for i in range(2):
            e.add_request(f"p{i}", prompts[i][:12], params)
    done = {b: {} for b in engines}
    while any(e.has_unfinished_requests() for e in engines.values()):
        for b, e in engines.items():
            before = dict(calls)
            for out in e.step():
                if out.finished:
                    done[b][out.request_id] = out.outputs[0].token_ids
            other = "torch" if b == "triton" else "triton"
            assert calls[b] > before[b] and calls[other] == before[other]  # this step used its own kernels only
    want = [r[:3] for r in hf_greedy(hf_model(path), [p[:12] for p in prompts[:2]], 3)]
    assert [done["torch"][f"p{i}"] for i in range(2)] == [done["triton"][f"p{i}"] for i in range(2)] == want
    for e in engines.values():
        check_no_leak(e)


def test_stop_token_ids_min_tokens_and_max_tokens(tiny):
    path, loaded, prompts, ref = tiny
    engine = LLMEngine(EngineArgs(model=str(path), detokenize=False, kv_cache_memory=1 << 22), loaded=loaded)
    target = ref[0][3]
    first = ref[0].index(target)
    out = run_engine(engine, [prompts[0]], SamplingParams(temperature=0, max_tokens=N_NEW, stop_token_ids=[target],
                                                          ignore_eos=True))
    assert out[0] == ref[0][:first + 1]
    out = run_engine(engine, [prompts[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert out[0] == ref[0][:3]
    out = run_engine(engine, [prompts[0]], SamplingParams(temperature=0, max_tokens=N_NEW, min_tokens=N_NEW,
                                                          stop_token_ids=[target], ignore_eos=True))
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
    out = run_engine(engine, prompts[:4], GREEDY)
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

    class Oracle(Proposer):
        def propose(self, batch: ProposeInput) -> DraftProposal:
            out = {}
            for r in batch.requests:
                want = ref[index[r.request_id]][r.num_output_tokens:r.num_output_tokens + 3]
                if kind == "wrong":
                    want = [(t + 1) % 96 for t in want]
                elif kind == "half":
                    want = want[:1] + [(t + 1) % 96 for t in want[1:]]
                out[r.request_id] = want
            return DraftProposal(out)

    engine.set_proposer(Oracle(SpeculativeConfig(method="ngram", num_speculative_tokens=3)))
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
