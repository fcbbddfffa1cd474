"""Tool calls on /v1/chat/completions, as vLLM does them. `tool_choice` `required` and a named
function are constrained by structured outputs (a JSON array of {name, parameters} over the
tools' schemas; the named tool's own schema; the JSON's own separators, no free whitespace), so
their calls always parse; `auto` lets the model
write and a tool-call parser (`--tool-call-parser`, with `--enable-auto-tool-choice`) finds the
calls in its text: `hermes`, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes,
Qwen). Calls come back in OpenAI's shape, `function.arguments` as JSON text."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from llmopt.serve.protocol import ChatCompletionRequest, ChatMessage, OpenAIError

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_ANY_OBJECT = {"type": "object"}


@dataclass
class ToolPlan:
    """What a request asks of its tools: `mode` none | auto | required | named."""
    mode: str
    name: str | None = None           # the named function
    parser: str | None = None         # auto: the --tool-call-parser that reads the calls (PARSERS)
    schema: dict | None = None        # the output's JSON schema (required, named)


def plan(body: ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """The request's tool mode, checked against its tools and the server's flags (400s). `parser`:
    the server's --tool-call-parser when --enable-auto-tool-choice is on, else None (no auto)."""
    tools, choice = body.tools or [], body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise OpenAIError("tool_choice needs tools: send the tools it chooses from", 400, "tool_choice")
        return ToolPlan("none")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolPlan("none")
    if choice == "auto":
        if parser is None:
            raise OpenAIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                              'set', 400, "tool_choice")
        return ToolPlan("auto", parser=parser)
    if choice == "required":
        items = [{"properties": {"name": {"type": "string", "enum": [t.function.name]},
                                 "parameters": t.function.parameters or _ANY_OBJECT},
                  "required": ["name", "parameters"]} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", schema=schema)
    named = next((t for t in tools if t.function.name == choice.function.name), None)
    if named is None:
        raise OpenAIError(f"tool_choice names the function {choice.function.name!r}, which is not in tools", 400,
                          "tool_choice")
    return ToolPlan("named", named.function.name, schema=named.function.parameters or _ANY_OBJECT)


def call(name: str, arguments) -> dict:
    """One tool call in OpenAI's shape (a new id; `arguments` as JSON text)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": text}}


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """(content before the first call, the calls) of a Hermes-format output; text whose calls do
    not parse is content alone, as vLLM's parser gives it."""
    if "<tool_call>" not in text:
        return text, []
    calls = []
    try:
        for closed, open_end in _HERMES.findall(text):
            obj = json.loads(closed or open_end)
            calls.append(call(obj["name"], obj.get("arguments", {})))
    except (json.JSONDecodeError, KeyError, TypeError):
        return text, []
    content = text[:text.find("<tool_call>")]
    return (content if content.strip() else None), calls


# --tool-call-parser NAME -> the function that finds the calls in a model's text
PARSERS = {"hermes": parse_hermes}


def parse(p: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished output under the request's plan."""
    if p.mode == "auto":
        return PARSERS[p.parser](text)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:      # cut short by max_tokens: the text as it is
        return text, []
    if p.mode == "named":
        return None, [call(p.name, obj)]
    if p.mode == "required" and isinstance(obj, list):
        return None, [call(c["name"], c["parameters"]) for c in obj]
    return text, []


def template_messages(messages: list[ChatMessage], text_of) -> list[dict]:
    """Messages as chat templates read them: assistant tool calls with their arguments as objects
    (as vLLM passes them), a tool result with its tool_call_id."""
    out = []
    for m in messages:
        d: dict = {"role": m.role, "content": text_of(m)}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _loads(c.function.arguments)}}
                               for c in m.tool_calls]
        out.append(d)
    return out


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
