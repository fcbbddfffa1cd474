"""Tool calls on /v1/chat/completions, as vLLM does them. `tool_choice` `required` and a named
function are constrained by structured outputs (a JSON array of {name, parameters} over the
tools' schemas; the named tool's own schema; the JSON's own separators, no free whitespace), so
their calls always parse; `auto` lets the model
write and a tool-call parser (`--tool-call-parser`, with `--enable-auto-tool-choice`; the formats
are in tool_parsers.py) finds the calls in its text. Calls come back in OpenAI's shape,
`function.arguments` as JSON text, whole or streamed as deltas (`ToolCallStream`)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from llmopt.serve.protocol import ChatCompletionRequest, ChatMessage, OpenAIError
from llmopt.serve.tool_parsers import PARSERS, Scan, scan_named, scan_required

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


def scan(p: ToolPlan, text: str, final: bool) -> Scan:
    """The content and calls of `text` (growing while not `final`) under the request's plan."""
    if p.mode == "auto":
        return PARSERS[p.parser](text, final)
    if p.mode == "named":
        return scan_named(p.name, text, final)
    return scan_required(text, final)


def parse(p: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls in OpenAI's shape) of a finished output under the request's plan."""
    found = scan(p, text, final=True)
    return found.content, [call(c.name, c.arguments) for c in found.calls]


class ToolCallStream:
    """One streamed choice under a tool plan: each update scans the text so far and gives the
    delta's new content and tool-call pieces (a call's first piece: its index, id, type and name;
    then pieces of its arguments), so the deltas add up to `parse` of the final text."""

    def __init__(self, p: ToolPlan) -> None:
        self.plan, self.content_sent, self.args_sent = p, 0, []

    def update(self, text: str, final: bool) -> dict:
        found = scan(self.plan, text, final)
        delta: dict = {}
        content = found.content or ""
        if not final and not content.strip():
            content = ""   # blank content before a call is None in the whole response: hold it
        if len(content) > self.content_sent:
            delta["content"] = content[self.content_sent:]
            self.content_sent = len(content)
        pieces = []
        for k, c in enumerate(found.calls):
            if k == len(self.args_sent):
                first = call(c.name, c.arguments)
                pieces.append({"index": k, **first})
                self.args_sent.append(len(c.arguments))
            elif len(c.arguments) > self.args_sent[k]:
                pieces.append({"index": k, "function": {"arguments": c.arguments[self.args_sent[k]:]}})
                self.args_sent[k] = len(c.arguments)
        if pieces:
            delta["tool_calls"] = pieces
        return delta

    @property
    def called(self) -> bool:
        return bool(self.args_sent)


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
