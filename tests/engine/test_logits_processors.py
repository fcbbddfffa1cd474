"""vLLM's per-request logits processors: `logit_bias`, `allowed_token_ids` and `bad_words`.
The sampler against a float64 computation of the processed distribution (applied before the
penalties, logprobs kept raw), and the engine on a tiny model against its own greedy output: a
banned word, a forced token and an allowed set change what is generated exactly as they say."""

import pytest
import torch

from engine_helpers import check_no_leak
from llmopt.core.logits_processors import bad_words_token_ids
from llmopt.core.sampler import Sampler, SamplingRow
from llmopt.core.sampling_params import SamplingParams
from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.errors import UserInputError
from llmopt.models.loader import load_model


def test_sampler_applies_bias_allowed_ids_and_bad_words_before_penalties():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    bias = {4: 3.5, 7: -100.0, 9: 250.0}            # 250 is clamped to 100
    rows = [SamplingRow(SamplingParams(temperature=0.7, logit_bias=bias, repetition_penalty=1.3, logprobs=1),
                        [1, 2], [4]),
            SamplingRow(SamplingParams(temperature=0.7, allowed_token_ids=[3, 11, 12]), [1], []),
            SamplingRow(SamplingParams(temperature=0.7), [1], [20, 21], bad_words=[[21, 30], [22, 40], [5]])]
    out = Sampler(0)(logits, rows, return_probs=True)
    ref = logits.double().clone()
    for t, b in bias.items():
        ref[0, t] += min(b, 100.0)
    seen = torch.tensor([1, 2, 4])                  # HF repetition penalty on prompt + output, after the bias
    ref[0, seen] = torch.where(ref[0, seen] > 0, ref[0, seen] / 1.3, ref[0, seen] * 1.3)
    keep = torch.zeros(50, dtype=torch.bool)
    keep[[3, 11, 12]] = True
    ref[1, ~keep] = float("-inf")
    ref[2, [30, 5]] = float("-inf")                 # output ends with 21: its continuation 30; 40 stays
    want = torch.softmax(ref / 0.7, -1)
    assert torch.allclose(out.probs.double(), want, atol=1e-6)
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0].double(), -1)[out.token_ids[0]]),
                                            abs=1e-5)                 # raw logprobs, as vLLM's


def test_sampling_params_check_the_new_fields():
    assert SamplingParams(logit_bias={"3": 500}).logit_bias == {3: 100.0}
    for kw, msg in [(dict(logit_bias={1: float("nan")}), "finite"), (dict(allowed_token_ids=[]), "must not be empty"),
                    (dict(bad_words=[" "]), "bad_words must not be empty")]:
        with pytest.raises(UserInputError, match=msg):
            SamplingParams(**kw)


@pytest.fixture(scope="module")
def engine(tiny_factory):
    path = tiny_factory(tokenizer=True, max_position_embeddings=512)
    loaded = load_model(str(path), "float32", "cpu")
    return LLMEngine(EngineArgs(model=str(path), kv_cache_memory=1 << 22), loaded=loaded)


def _generate(engine, prompt, **kw):
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.outputs[0].token_ids


def test_the_engine_honours_them(engine):
    prompt = "The history of the river"
    plain = _generate(engine, prompt)
    assert _generate(engine, prompt, logit_bias={plain[0]: -100.0})[0] != plain[0]
    assert set(_generate(engine, prompt, logit_bias={17: 100.0})) == {17}
    assert set(_generate(engine, prompt, allowed_token_ids=[17, 300])) <= {17, 300}
    word = engine.tokenizer.decode(plain[2:4])      # a two-token stretch the model generates greedily
    banned = bad_words_token_ids(engine.tokenizer, [word])
    got = _generate(engine, prompt, bad_words=[word])
    assert got[:2] == plain[:2] and not any(got[i:i + len(s)] == s for s in banned for i in range(len(got)))
    with pytest.raises(UserInputError, match="logit_bias token id 99999 is outside the vocabulary"):
        engine.add_request("x", prompt, SamplingParams(logit_bias={99999: 1.0}))
    with pytest.raises(UserInputError, match="allowed_token_ids id -1 is outside"):
        engine.add_request("x", prompt, SamplingParams(allowed_token_ids=[-1]))
    check_no_leak(engine)
