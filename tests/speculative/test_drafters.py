"""Each drafting method in the engine on tiny random models: greedy outputs identical with
speculation on and off (penalties included), counters that add up, no block leaked after rejected
drafts, preemptions (a KV cache too small for the batch) and aborts; speculation off at
disable_by_batch_size; the config's vLLM keys and defaults."""

import random

import pytest

from engine_helpers import check_no_leak, run_engine
from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.core.sampling_params import SamplingParams
from llmopt.errors import UserInputError
from llmopt.models.loader import load_model
from llmopt.speculative.config import SpeculativeConfig, parse_speculative_config
from llmopt.speculative.ngram import ngram_propose

N_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
PENALTY = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, repetition_penalty=1.3,
                         frequency_penalty=0.5)


def _prompts(n=10, vocab=96, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        motif = [rng.randrange(vocab) for _ in range(rng.randint(2, 6))]
        noise = [rng.randrange(vocab) for _ in range(rng.randint(0, 20))]
        out.append(noise + motif * rng.randint(2, 6))   # repeats that prompt lookup can find
    return out


@pytest.fixture(scope="module")
def models(tiny_factory):
    target = tiny_factory(seed=0)
    draft = tiny_factory(seed=5, num_hidden_layers=1)
    return target, load_model(str(target), "float32", "cpu", tokenizer=False), draft


def _engine(models, spec, **kw):
    target, loaded, draft = models
    if spec is not None and spec.get("model") == "DRAFT":
        spec = {**spec, "model": str(draft)}
    elif spec is not None and spec.get("model") == "SELF":
        spec = {**spec, "model": str(target)}
    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLMEngine(EngineArgs(model=str(target), detokenize=False, block_size=4, speculative_config=spec, **kw),
                     loaded=loaded)


SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "draft_model": {"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 3},
    "self_draft": {"method": "draft_model", "model": "SELF", "num_speculative_tokens": 4},
}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("params", [GREEDY, PENALTY], ids=["greedy", "penalties"])
def test_greedy_identity_and_counters(models, name, params):
    prompts = _prompts()
    ref = run_engine(_engine(models, None), prompts, params)
    engine = _engine(models, SPECS[name])
    assert run_engine(engine, prompts, params) == ref
    check_no_leak(engine)
    st = engine.stats().spec_decoding
    assert st.num_drafts > 0 and st.num_draft_tokens >= st.num_drafts
    assert st.num_accepted_tokens == sum(st.num_accepted_tokens_per_pos)
    assert all(a >= b for a, b in zip(st.num_accepted_tokens_per_pos, st.num_accepted_tokens_per_pos[1:]))
    assert st.mean_acceptance_length == 1 + st.num_accepted_tokens / st.num_drafts
    if name == "self_draft" and params is GREEDY:   # the target drafting for itself: every draft is taken
        assert st.num_accepted_tokens == st.num_draft_tokens
    if name == "draft_model":                        # a different random model: some drafts are rejected
        assert st.num_accepted_tokens < st.num_draft_tokens


@pytest.mark.parametrize("name", ["ngram", "draft_model", "self_draft"])
def test_preemption_and_abort_leak_nothing(models, name):
    prompts = _prompts(12, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = run_engine(_engine(models, None), prompts, params)
    # a cache of about 120 tokens for 12 prompts of up to 80
    engine = _engine(models, SPECS[name], kv_cache_memory=256 * 4 * 60, max_model_len=96)
    assert run_engine(engine, prompts, params) == ref
    assert engine.stats().num_preemptions > 0
    check_no_leak(engine)
    engine = _engine(models, SPECS[name])
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    for _ in range(4):
        engine.step()
    engine.abort_request([f"r{i}" for i in range(0, 12, 2)])
    while engine.has_unfinished_requests():
        engine.step()
    check_no_leak(engine)


def test_sampled_requests_with_a_draft_model_run(models):
    prompts = _prompts(6, seed=2)
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=N_NEW, ignore_eos=True, seed=3)
    a = run_engine(_engine(models, SPECS["draft_model"]), prompts, params)
    b = run_engine(_engine(models, SPECS["draft_model"]), prompts, params)
    assert a == b and all(len(x) == N_NEW for x in a)


def test_disable_by_batch_size_turns_speculation_off(models):
    prompts = _prompts(8, seed=3)
    engine = _engine(models, {**SPECS["self_draft"], "disable_by_batch_size": 4})
    engine.add_request("a", prompts[0], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    alone = engine.stats().spec_decoding.num_drafts
    assert alone > 0
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()    # all 8 prefill
    engine.step()
    assert engine.stats().spec_decoding.num_drafts == alone   # 8 running >= 4: no drafts
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                            num_speculative_tokens_by_batch_size={1: 4, 4: 2, 16: 0})
    assert [cfg.num_tokens_for_batch(b) for b in (1, 3, 4, 15, 16, 64)] == [4, 4, 2, 2, 0, 0]


def test_config_keys_and_defaults(tmp_path):
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == (5, 5, None)
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    assert parse_speculative_config({"model": "m", "num_speculative_tokens": 2}).method == "draft_model"
    (tmp_path / "spec_config.json").write_text('{"method": "eagle", "model": "head", "num_speculative_tokens": 3,'
                                               ' "num_speculative_tokens_by_batch_size": {"1": 3, "8": 0}}')
    (tmp_path / "head").mkdir()
    c = parse_speculative_config(str(tmp_path))
    assert c.model == str(tmp_path / "head") and c.num_speculative_tokens_by_batch_size == {1: 3, 8: 0}
    for bad in ['{"method": "medusa", "num_speculative_tokens": 2}', '{"method": "ngram"}', '[1]', '{x',
                '{"method": "eagle", "num_speculative_tokens": 2}', '{"method": "ngram", "num_speculative_tokens": 2, "k": 1}',
                '{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}']:
        with pytest.raises(UserInputError):
            parse_speculative_config(bad)


def test_ngram_lookup():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3], 3, 1, 3) == [9, 1, 2]
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3], 1, 1, 3) == [9]
    assert ngram_propose([5, 1, 7, 1], 2, 1, 2) == [7, 1]      # the longest (2) misses, n = 1 hits
    assert ngram_propose([5, 6, 7, 8], 2, 1, 3) == []
    assert ngram_propose([4, 4, 4], 2, 2, 2) == [4]             # overlapping earlier occurrence
