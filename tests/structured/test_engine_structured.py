"""Structured outputs through the engine on a tiny random model with the default model's tokenizer
(its unconstrained text is noise, so every constraint has to come from the mask): every output of a
JSON schema, a regex and a choice ends with "stop" and passes the constraint's own checker
(jsonschema, re.fullmatch, membership), sampled and greedy, n > 1 included; and the constrained
greedy outputs are the same alone, in a mixed batch, under preemption and with n-gram speculative
decoding."""

import json
import re

import jsonschema
import pytest

from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.core.sampling_params import SamplingParams
from llmopt.errors import UserInputError

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
          "required": ["id", "kind", "ok"], "additionalProperties": False}
RX = r"[a-z]{3}-\d{2}"
CHOICES = ["alpha", "beta", "gamma"]
CONSTRAINTS = [dict(json=SCHEMA, disable_any_whitespace=True), dict(regex=RX), dict(choice=CHOICES)]
PROMPTS = ["Give me a record:", "The answer is", "Name one letter of the Greek alphabet"]


def _check(kind: dict, text: str) -> None:
    if "json" in kind:
        jsonschema.validate(json.loads(text), SCHEMA)
    elif "regex" in kind:
        assert re.fullmatch(RX, text), text
    else:
        assert text in CHOICES


@pytest.fixture(scope="module")
def model(tiny_factory):
    return str(tiny_factory(tokenizer=True, max_position_embeddings=256))


def _engine(model, **kw):
    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLMEngine(EngineArgs(model=model, **kw))


def _run(engine, jobs):
    for rid, prompt, params in jobs:
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_sampled_outputs_always_match(model):
    engine = _engine(model)
    jobs = [(f"{i}-{s}", PROMPTS[i], SamplingParams(temperature=1.0, seed=s, n=2, max_tokens=40,
                                                   structured_outputs=c))
            for i, c in enumerate(CONSTRAINTS) for s in range(3)]
    done = _run(engine, jobs)
    for rid, _, params in jobs:
        for o in done[rid].outputs:
            assert o.finish_reason == "stop", (rid, o.text)
            _check({params.structured_outputs.kind: True}, o.text)


def _greedy(c):
    return SamplingParams(temperature=0, max_tokens=40, structured_outputs=c)


def test_greedy_outputs_are_the_same_batched_preempted_and_speculated(model):
    alone = {}
    for i, c in enumerate(CONSTRAINTS):
        out = _run(_engine(model), [(str(i), PROMPTS[i], _greedy(c))])[str(i)].outputs[0]
        assert out.finish_reason == "stop"
        _check(c, out.text)
        alone[str(i)] = out.token_ids
    mixed = [(str(i), PROMPTS[i], _greedy(c)) for i, c in enumerate(CONSTRAINTS)]
    mixed += [(f"free{i}", p, SamplingParams(temperature=0, max_tokens=30)) for i, p in enumerate(PROMPTS)]
    # 2 layers * 2 (K, V) * 2 kv heads * 16 head dim * 4 bytes = 256 bytes a token: 12 blocks of 16
    for kw in [dict(), dict(kv_cache_memory=256 * 16 * 12, max_model_len=64, max_num_batched_tokens=16),
               dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                        "prompt_lookup_max": 2})]:
        engine = _engine(model, **kw)
        done = _run(engine, mixed)
        assert {k: done[k].outputs[0].token_ids for k in alone} == alone, kw
        if "kv_cache_memory" in kw:
            assert engine.stats().num_preemptions > 0
        if "speculative_config" in kw:
            assert engine.stats().spec_decoding.num_draft_tokens > 0


def test_an_invalid_constraint_is_refused_at_add(model):
    engine = _engine(model)
    with pytest.raises(UserInputError, match="unclosed group"):
        engine.add_request("bad", "hi", SamplingParams(structured_outputs=dict(regex="a(b")))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("extra", [dict(min_tokens=20), dict(allowed_token_ids=[0, 1, 2]), dict(bad_words=["alpha"])])
def test_the_grammar_wins_over_the_other_constraints(model, extra):
    """Where min_tokens (EOS blocked), allowed_token_ids or bad_words leave no token the grammar
    allows, the grammar's mask alone decides that row (schemathesis found this: the
    row was all -inf, its argmax token 0, and the request failed): the output still matches."""
    for temperature in (0, 1.0):
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=30, structured_outputs=dict(choice=CHOICES),
                                **extra)
        out = _run(_engine(model), [("r", PROMPTS[2], params)])["r"].outputs[0]
        assert out.finish_reason == "stop" and out.text in CHOICES, (extra, out.text)
