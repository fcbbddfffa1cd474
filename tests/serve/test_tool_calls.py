"""Tool calls on /v1/chat/completions: `tool_choice` required and a named function give calls that
parse and match the tools' schemas (jsonschema checks; the text equals the offline engine's under
the same constraint); a call, its `role: tool` result and the next turn go through a Hermes-style
`--chat-template` (the rendered prompt checked against the template rendered here by jinja2);
`auto` reads `<tool_call>` blocks with the hermes parser; streamed, every mode's deltas add up
(through the openai client's own stream) to the whole response's calls; the openai client gets
its objects; what cannot work is a 400 naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import pytest

from serve_util import API_KEY, MODEL_NAME, TINY_CHAT, free_port, serve_cmd, spawn, stop

TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def model(tiny_factory):
    return tiny_factory(**TINY_CHAT)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn(serve_cmd(model, port, "--max-model-len", "512", "--chat-template", str(TEMPLATE), "--enable-auto-tool-choice",
                           "--tool-call-parser", "hermes"), tmp_path_factory.mktemp("tools") / "server.log", url)
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def _chat(http, **body):
    r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 48, "temperature": 0,
                                                 "messages": ASK, "tools": TOOLS, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_constrained_tool_calls_parse_and_match_the_schemas(http, model, choice):
    from llmopt import LLM, SamplingParams
    from llmopt.serve.tool_calls import plan
    from llmopt.serve.protocol import ChatCompletionRequest
    got = _chat(http, tool_choice=choice, parallel_tool_calls=False)
    calls = got["message"]["tool_calls"]
    assert got["finish_reason"] == "tool_calls" and got["message"]["content"] is None, got
    assert len(calls) == 1
    for c in calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])
    if isinstance(choice, dict):
        assert calls[0]["function"]["name"] == "get_time"
    # the same text as the offline engine under the same schema, on the same rendered prompt
    body = ChatCompletionRequest(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=choice,
                                 parallel_tool_calls=False)
    llm = LLM(str(model), max_model_len=512, kv_cache_memory=1 << 22)
    from llmopt.structured.params import StructuredOutputsParams
    out = llm.generate([_render(model, ASK, TOOLS)], SamplingParams(
        max_tokens=48, temperature=0, structured_outputs=StructuredOutputsParams(json=plan(body, "hermes").schema,
                                                                   disable_any_whitespace=True)))[0]
    text = out.outputs[0].text
    args = json.loads(text)
    want = args[0]["parameters"] if choice == "required" else args
    assert json.loads(calls[0]["function"]["arguments"]) == want


def _render(model, messages, tools):
    """The template rendered by jinja2 itself (transformers' environment: tojson, no autoescape)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    return tok.apply_chat_template(messages, tools=tools, chat_template=TEMPLATE.read_text(), tokenize=False,
                                   add_generation_prompt=True)


def test_a_call_its_result_and_the_answer_round_trip(http, model):
    import openai
    client = openai.OpenAI(base_url=http.base_url.join("/v1").__str__(), api_key=API_KEY, max_retries=0)
    first = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=48, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name in SCHEMAS
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, temperature=0)
    assert second.choices[0].message.tool_calls in (None, []) and second.choices[0].finish_reason == "length"
    rendered = _render(model, [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in history],
        TOOLS)
    assert "<tool_response>sunny, 21 C</tool_response>" in rendered and f'"name": "{call.function.name}"' in rendered
    from transformers import AutoTokenizer
    assert second.usage.prompt_tokens == len(AutoTokenizer.from_pretrained(model)(rendered,
                                                                                   add_special_tokens=False).input_ids)


def test_auto_reads_the_models_text(http):
    got = _chat(http, tool_choice="auto", max_tokens=8)
    assert got["message"]["tool_calls"] == [] and got["message"]["content"] and got["finish_reason"] == "length"


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
], ids=["unknown-name", "no-tools", "two-constraints"])
def test_what_cannot_work_is_a_400(http, body, param):
    r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": ASK, "tools": TOOLS, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}</tool_call>'
STREAMED = {"required": dict(tool_choice="required"),
            "named": dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
            # auto, the model's text forced (a regex) to a Hermes block: the parser's work, streamed
            "auto": dict(tool_choice="auto", structured_outputs={"regex": re.escape(HERMES_CALL)})}


@pytest.mark.parametrize("mode", list(STREAMED))
def test_streamed_calls_add_up_to_the_whole_response(http, mode):
    """The openai client's stream of tool-call deltas (first piece: index, id, type, name; then
    argument pieces) accumulates to the calls, content and finish_reason of stream: false."""
    import openai
    client = openai.OpenAI(base_url=str(http.base_url.join("/v1")), api_key=API_KEY, max_retries=0)
    body = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=48, temperature=0)
    extra = dict(STREAMED[mode])
    so = {"structured_outputs": extra.pop("structured_outputs")} if "structured_outputs" in extra else None
    whole = client.chat.completions.create(**body, **extra, extra_body=so).choices[0]
    calls, content, finish, pieces = {}, "", None, 0
    for chunk in client.chat.completions.create(**body, **extra, extra_body=so, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or []:
                pieces += 1
                if piece.id is not None:
                    assert piece.index not in calls and piece.type == "function" and piece.function.name
                    calls[piece.index] = [piece.id, piece.function.name, piece.function.arguments or ""]
                else:
                    assert piece.function.name is None
                    calls[piece.index][2] += piece.function.arguments
    assert whole.finish_reason == finish == "tool_calls"
    assert (content or None) == whole.message.content
    got = [(name, json.loads(args)) for _, name, args in calls.values()]
    assert got == [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert pieces > len(calls)   # the arguments came in pieces, not whole at the end
    if mode == "auto":
        assert got == [("get_weather", {"city": "Oslo", "days": 3})] and whole.message.content is None
    for name, args in got:
        jsonschema.validate(args, SCHEMAS[name])
