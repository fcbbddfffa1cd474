"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's) against transformers' float32 forward of
each whole prompt: every position's log p(next prompt token), its rank and the top k, with the
prompt in one chunk or many, a prefix cache already warm with the prompts' shared prefix (which a
scored request must not read, unless it scores from a later position: prompt_logprobs_start),
preemption (a recompute scores nothing twice) and n > 1 samples (one list, the leader's). The
completions stay what greedy generation gives."""

import pytest
import torch

from engine_helpers import check_no_leak, hf_greedy, hf_model, mixed_prompts, run_outputs
from llmopt.core.sampling_params import SamplingParams
from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.errors import UserInputError
from llmopt.models.loader import load_model

K = 3
N_NEW = 4
SMALL_KV = 256 * 16 * 14  # 14 blocks of 16 tokens (2 layers, 2 KV heads of 16, float32): preempts


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    loaded = load_model(str(tiny_llama), "float32", "cpu", tokenizer=False)
    prompts = mixed_prompts(8, 96, lo=2, hi=60, shared_prefix=20)
    hf = hf_model(tiny_llama)
    ref = []
    with torch.no_grad():
        for p in prompts:
            lp = torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1)
            ref.append(lp)
    return tiny_llama, loaded, prompts, ref, hf_greedy(hf, prompts, N_NEW)


def _check(out, prompt, lp: torch.Tensor):
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i, entry in enumerate(got[1:], start=1):
        row, t = lp[i - 1], prompt[i]
        assert entry.token_id == t
        assert entry.logprob == pytest.approx(float(row[t]), abs=2e-4)
        assert entry.rank == int((row > row[t]).sum()) + 1
        want_top = torch.topk(row, K).indices.tolist()
        assert list(entry.top) == want_top
        assert list(entry.top.values()) == pytest.approx(row[want_top].tolist(), abs=2e-4)


@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=8), dict(kv_cache_memory=SMALL_KV, max_model_len=96),
                                dict(enable_prefix_caching=False, block_size=1)],
                         ids=["warm-prefix-cache", "chunk8", "preempt", "block1"])
def test_prompt_logprobs_match_transformers(tiny, kw):
    path, loaded, prompts, ref, greedy = tiny
    kw.setdefault("kv_cache_memory", 1 << 22)
    engine = LLMEngine(EngineArgs(model=str(path), detokenize=False, **kw), loaded=loaded)
    plain = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    run_outputs(engine, prompts[:2], plain)                       # the shared prefix is in the cache now
    hits = engine.stats().prefix_cache_hits
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, prompt_logprobs=K)
    outs = run_outputs(engine, prompts, params)
    for out, p, lp, want in zip(outs, prompts, ref, greedy):
        _check(out, p, lp)
        assert out.outputs[0].token_ids == want
        assert out.num_cached_tokens == 0                         # scored requests compute every position
    if kw["kv_cache_memory"] == SMALL_KV:     # a preempted request whose prompt is scored may read the cache
        assert engine.stats().num_preemptions > 0
    else:
        assert engine.stats().prefix_cache_hits == hits
    check_no_leak(engine)


@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=8), dict(enable_prefix_caching=False)],
                         ids=["one-step", "chunk8", "no-prefix-cache"])
def test_scoring_from_a_start_position_reads_the_shared_prefix_from_the_cache(tiny, kw):
    """prompt_logprobs_start = 20, the end of the prompts' shared prefix: positions from it on are
    scored as transformers scores them, the ones before are None, and with prefix caching every
    request after the first reads the prefix's full block (16 tokens) from the cache, even when all
    are scheduled in one step."""
    path, loaded, prompts, ref, greedy = tiny
    engine = LLMEngine(EngineArgs(model=str(path), detokenize=False, kv_cache_memory=1 << 22, **kw), loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, prompt_logprobs=K,
                            prompt_logprobs_start=20)
    outs = run_outputs(engine, prompts, params)
    for out, p, lp, want in zip(outs, prompts, ref, greedy):
        got = out.prompt_logprobs
        assert len(got) == len(p) and got[:20] == [None] * 20
        for i in range(20, len(p)):
            assert got[i].token_id == p[i]
            assert got[i].logprob == pytest.approx(float(lp[i - 1, p[i]]), abs=2e-4)
            assert got[i].rank == int((lp[i - 1] > lp[i - 1, p[i]]).sum()) + 1
            assert list(got[i].top) == torch.topk(lp[i - 1], K).indices.tolist()
        assert out.outputs[0].token_ids == want
    cached = [o.num_cached_tokens for o in outs]
    assert cached == ([0] * 8 if kw.get("enable_prefix_caching") is False else [0] + [16] * 7)
    (out,) = run_outputs(engine, [prompts[0]], SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                               prompt_logprobs_start=len(prompts[0])))
    assert out.prompt_logprobs == [None] * len(prompts[0])       # a start past the prompt scores nothing
    check_no_leak(engine)


def test_n_samples_share_the_prompts_logprobs_and_zero_means_the_token_alone(tiny):
    path, loaded, prompts, ref, greedy = tiny
    engine = LLMEngine(EngineArgs(model=str(path), detokenize=False, kv_cache_memory=1 << 22), loaded=loaded)
    (out,) = run_outputs(engine, [prompts[5]], SamplingParams(n=2, temperature=0.0, max_tokens=N_NEW, ignore_eos=True,
                                                               prompt_logprobs=K))
    _check(out, prompts[5], ref[5])
    assert [c.token_ids for c in out.outputs] == [greedy[5]] * 2
    (out,) = run_outputs(engine, [prompts[1]], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    assert all(e.top == {} for e in out.prompt_logprobs[1:])
    assert [e.logprob for e in out.prompt_logprobs[1:]] == pytest.approx(
        [float(ref[1][i - 1, t]) for i, t in enumerate(prompts[1]) if i], abs=2e-4)
    (out,) = run_outputs(engine, [prompts[1]], SamplingParams(temperature=0.0, max_tokens=1))
    assert out.prompt_logprobs is None                            # not asked: not computed
    check_no_leak(engine)


def test_prompt_logprobs_out_of_range_are_refused():
    for bad in (-1, 21):
        with pytest.raises(UserInputError, match=r"prompt_logprobs must be in \[0, 20\]"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(UserInputError, match="prompt_logprobs_start must be >= 0, got -1"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_start=-1)
