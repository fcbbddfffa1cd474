"""Tool-call scanning, streamed and whole: for texts of each format (Hermes blocks, a named call's
arguments, required's array), fed one character at a time to ToolCallStream, the deltas add up to
what the whole response gives, and that equals the calls json.loads reads from the same text (the
independent reference); a cut-short text keeps the calls as far as they got, as OpenAI's API."""

from __future__ import annotations

import json

import pytest

from llmopt.serve.tool_calls import ToolCallStream, ToolPlan, parse

WEATHER = {"city": "Lima", "days": 2, "notes": "dry, {not} \"a\" </tool_call>"}
HERMES = [
    ('Let me look.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + '}\n</tool_call>',
     "Let me look.", [("get_time", {"zone": "UTC"}), ("get_weather", WEATHER)]),
    ('\n<tool_call>{"arguments": {"days": 10}, "name": "get_weather"}', None,   # arguments first, unclosed
     [("get_weather", {"days": 10})]),
    ('<tool_call>{"name": "get_time"}</tool_call>', None, [("get_time", {})]),
    ("no calls here, only a < and <tool", "no calls here, only a < and <tool", []),
    ('<tool_call>{"name": broken</tool_call>', '<tool_call>{"name": broken</tool_call>', []),
]
REQUIRED = '[{"name":"get_weather","parameters":' + json.dumps(WEATHER) + '},{"name":"get_time","parameters":{"zone":"CET"}}]'


def _streamed(p: ToolPlan, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """Feed `text` one character at a time; (content, [(name, arguments)]) the deltas add up to."""
    s, content, calls, ids = ToolCallStream(p), "", [], set()
    for i in range(1, len(text) + 1):
        delta = s.update(text[:i], final=i == len(text))
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            if piece["index"] == len(calls):
                assert piece["type"] == "function" and piece["id"] not in ids
                ids.add(piece["id"])
                calls.append([piece["function"]["name"], piece["function"]["arguments"]])
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
                calls[piece["index"]][1] += piece["function"]["arguments"]
    return content or None, [tuple(c) for c in calls]


def _whole(p: ToolPlan, text: str):
    content, calls = parse(p, text)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("text,content,want", HERMES, ids=["two-calls", "args-first", "no-args", "no-call", "broken"])
def test_hermes_stream_adds_up_to_the_whole(text, content, want):
    p = ToolPlan("auto", parser="hermes")
    whole = _whole(p, text)
    assert _streamed(p, text) == whole
    assert whole[0] == content and [(n, json.loads(a)) for n, a in whole[1]] == want


def test_required_and_named_stream_adds_up_to_the_whole():
    p = ToolPlan("required")
    assert _streamed(p, REQUIRED) == _whole(p, REQUIRED)
    assert [(n, json.loads(a)) for n, a in _whole(p, REQUIRED)[1]] == [
        (c["name"], c["parameters"]) for c in json.loads(REQUIRED)]
    named, args = ToolPlan("named", "get_weather"), json.dumps(WEATHER)
    assert _streamed(named, args) == _whole(named, args) == (None, [("get_weather", args)])


def test_a_cut_short_text_keeps_its_calls_so_far():
    cut = REQUIRED[:REQUIRED.index('"zone"') + 3]
    p = ToolPlan("required")
    assert _streamed(p, cut) == _whole(p, cut)
    (n1, a1), (n2, a2) = _whole(p, cut)[1]
    assert (n1, json.loads(a1)) == ("get_weather", WEATHER) and n2 == "get_time" and a2 == '{"zo'
