"""Structured outputs' backend on the default model's tokenizer: random logits masked step by step
by a request's grammar always decode to text that the constraint's own checker accepts (jsonschema
for schemas, `re.fullmatch` for regexes, membership for choices), and the bitmask rows for draft
tokens equal the rows filled one accepted token at a time."""

import json
import re

import jsonschema
import pytest
import torch

from llmopt.errors import UserInputError
from llmopt.structured import StructuredOutputsParams as P
from llmopt.structured import backend

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    from llmopt.models.loader import resolve_checkpoint
    return AutoTokenizer.from_pretrained(str(resolve_checkpoint(None)))


@pytest.fixture(scope="module")
def manager(tok):
    return backend.StructuredOutputManager(tok, 49152, [tok.eos_token_id])


def _walk(manager, tok, params, seed, steps=200, bias_eos=0.0, bias: str = ""):
    """Sample from random logits under the grammar until EOS or the grammar ends; the text.
    `bias_eos` and the single-character tokens of `bias` are favoured, so walks end."""
    g = manager.grammar(params)
    gen = torch.Generator().manual_seed(seed)
    bm = manager.allocate_bitmask(1)
    out = []
    for _ in range(steps):
        g.fill(bm, 0)
        logits = torch.randn(1, 49152, generator=gen) * 3
        logits[0, tok.eos_token_id] += bias_eos
        for c in bias:
            logits[0, tok.convert_tokens_to_ids(c)] += 12
        backend.apply_bitmask(logits, bm, [0])
        t = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        assert g.accept([t])
        if t == tok.eos_token_id:
            break
        out.append(t)
        if g.is_terminated:
            break
    else:
        pytest.fail(f"no end in {steps} steps: {tok.decode(out)!r}")
    return tok.decode(out)


@pytest.mark.parametrize("seed", range(4))
def test_schema_outputs_validate(manager, tok, seed):
    text = _walk(manager, tok, P(json=SCHEMA, disable_any_whitespace=True), seed, steps=400, bias_eos=20)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_closed_objects(manager, tok):
    assert isinstance(json.loads(_walk(manager, tok, P(json_object=True, disable_any_whitespace=True), 0, steps=400, bias_eos=25,
                                                 bias='"}:1')), dict)
    open_schema = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}
    closed = P(json=open_schema, disable_additional_properties=True, disable_any_whitespace=True)
    text = _walk(manager, tok, closed, 1, steps=300, bias_eos=25, bias='"}')
    assert list(json.loads(text)) == ["x"]


@pytest.mark.parametrize("seed", range(3))
def test_regex_choice_and_grammar(manager, tok, seed):
    rx = r"[A-Z][a-z]{2,6}-\d{3}"
    assert re.fullmatch(rx, _walk(manager, tok, P(regex=rx), seed))
    choices = ("positive", "negative", "neutral")
    assert _walk(manager, tok, P(choice=choices), seed) in choices
    gbnf = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'
    assert re.fullmatch(r"\(\d+(,\d+)*\)", _walk(manager, tok, P(grammar=gbnf), seed, bias_eos=15))


def test_draft_rows_equal_step_by_step_rows(manager, tok):
    g = manager.grammar(P(json=SCHEMA))
    drafts = tok.encode('{"name": "Al', add_special_tokens=False)
    bm = manager.allocate_bitmask(len(drafts) + 1)
    g.fill(bm, 0, drafts)
    ref = manager.grammar(P(json=SCHEMA))
    one = manager.allocate_bitmask(1)
    for j in range(len(drafts) + 1):
        ref.fill(one, 0)
        assert torch.equal(bm[j], one[0]), j
        if j < len(drafts):
            assert ref.accept([drafts[j]])
    # the drafts were rolled back: the request's own matcher is where it started
    g.fill(one, 0)
    fresh = manager.allocate_bitmask(1)
    manager.grammar(P(json=SCHEMA)).fill(fresh, 0)
    assert torch.equal(one, fresh)


def test_a_refused_draft_ends_the_constrained_rows(manager, tok):
    g = manager.grammar(P(regex=r"\d+"))
    bad = tok.encode("12ab", add_special_tokens=False)
    bm = manager.allocate_bitmask(len(bad) + 1)
    g.fill(bm, 0, bad)
    assert int((bm[-1] == -1).all())        # rows after the refused draft allow everything
    digit = tok.encode("7", add_special_tokens=False)[0]
    assert (int(bm[0, digit // 32]) >> (digit % 32)) & 1


def test_forks_keep_their_own_state(manager, tok):
    g = manager.grammar(P(choice=("yes", "no")))
    f = g.fork()
    assert g.accept(tok.encode("yes", add_special_tokens=False))
    assert f.accept(tok.encode("no", add_special_tokens=False))
    assert not g.accept(tok.encode("no", add_special_tokens=False))


def test_each_constraint_compiles_once_and_requests_keep_their_own_state(tok, monkeypatch):
    """The second request of a constraint copies the compiled matcher (no second compile); its
    state is its own; a schema whose properties come in another order is another constraint (the
    order of the generated JSON's keys follows it)."""
    manager = backend.StructuredOutputManager(tok, 49152, [tok.eos_token_id])
    compiles = []
    compile_ = manager._compile
    monkeypatch.setattr(manager, "_compile", lambda p: compiles.append(p) or compile_(p))
    a, b = manager.grammar(P(choice=("yes", "no"))), manager.grammar(P(choice=("yes", "no")))
    assert len(compiles) == 1
    assert a.accept(tok.encode("yes", add_special_tokens=False)) and b.accept(tok.encode("no", add_special_tokens=False))
    two = {"type": "object", "properties": {"x": {"const": 1}, "y": {"const": 2}}, "required": ["x", "y"],
           "additionalProperties": False}
    swapped = {**two, "properties": dict(reversed(list(two["properties"].items()))), "required": ["y", "x"]}
    texts = [_walk(manager, tok, P(json=s, disable_any_whitespace=True), seed=0, bias_eos=20) for s in (two, swapped)]
    assert len(compiles) == 3 and texts == ['{"x":1,"y":2}', '{"y":2,"x":1}']


@pytest.mark.parametrize("params, words", [
    (dict(regex="a(b"), "unclosed group"),
    (dict(json={"type": "object", "properties": {"a": {"type": "frobnicate"}}}), "frobnicate"),
    (dict(json="{not json"), "not JSON"),
    (dict(grammar="start: foo"), "foo"),
])
def test_invalid_constraints_are_one_line_errors(manager, params, words):
    with pytest.raises(UserInputError, match=words) as e:
        manager.grammar(P(**params))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw", [{}, dict(regex="a", choice=["a"]), dict(choice="ab"), dict(choice=[]), dict(regex="")])
def test_params_take_exactly_one_constraint(kw):
    with pytest.raises(UserInputError, match="structured outputs"):
        P(**kw)
