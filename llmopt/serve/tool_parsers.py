"""Finding tool calls in a model's text, finished or still growing, so that a stream and a whole
response say the same: `scan(mode, text, final)` gives the content and the calls as far as the
text goes, and each scan of a longer text only extends the one before (content and a call's
arguments grow, calls are added once their name is complete, nothing is taken back). The
streaming side (tool_calls.ToolCallStream) sends the differences; a whole response is the scan
of its final text.

A call's `arguments` is the model's own JSON text of its arguments (OpenAI's convention: the
model's string, not a re-serialization), so streamed pieces concatenate to it. Formats:
- `hermes` (`--tool-call-parser hermes`, tool_choice auto): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks (Hermes, Qwen); content is the text before the first block (None
  when blank, as vLLM's parser gives it); a text whose blocks name no function is content alone.
- `named` (a named tool_choice): the whole text is the arguments object.
- `required`: a JSON array of {"name": ..., "parameters": {...}}, vLLM's constrained form.
A text cut short (max_tokens) keeps its calls with the arguments as far as they got, as OpenAI's
API does with finish_reason "length"."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

TAG, END_TAG = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


@dataclass
class ScannedCall:
    name: str
    arguments: str = ""   # the JSON text of the arguments so far


@dataclass
class Scan:
    content: str | None
    calls: list[ScannedCall] = field(default_factory=list)


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _value(s: str, i: int, final: bool):
    """(value, end) of the JSON value starting at s[i], or (None, None) while it is incomplete (a
    number or literal that ends a growing text may still grow)."""
    try:
        value, end = _DECODER.raw_decode(s, i)
    except json.JSONDecodeError:
        return None, None
    if end == len(s) and not final and s[i] not in '{["':
        return None, None
    return value, end


def _object(s: str, i: int, final: bool) -> tuple[dict[str, tuple[int, int | None, object]], int | None]:
    """The fields of the JSON object at s[i:] as far as the text goes (key -> value start, value end
    or None while incomplete, value) and the object's end (None while it is open or malformed)."""
    fields: dict[str, tuple[int, int | None, object]] = {}
    i = _skip(s, i)
    if i >= len(s) or s[i] != "{":
        return fields, None
    i += 1
    while True:
        i = _skip(s, i)
        if i < len(s) and s[i] == ",":
            i = _skip(s, i + 1)
        if i >= len(s):
            return fields, None
        if s[i] == "}":
            return fields, i + 1
        key, end = _value(s, i, final)
        if not isinstance(key, str):
            return fields, None
        i = _skip(s, end)
        start = _skip(s, i + 1)
        if i >= len(s) or s[i] != ":" or start >= len(s):
            return fields, None
        value, end = _value(s, start, final)
        fields[key] = (start, end, value)
        if end is None:
            return fields, None
        i = end


def _call(s: str, fields: dict, closed: bool, keys: tuple[str, ...]) -> ScannedCall | None:
    """The call of one scanned {name, arguments} object: None until its name is complete."""
    name = fields.get("name")
    if name is None or name[1] is None or not isinstance(name[2], str):
        return None
    key = next((k for k in keys if k in fields), None)
    if key is None:
        return ScannedCall(name[2], "{}" if closed else "")
    start, end, _ = fields[key]
    return ScannedCall(name[2], s[start:end] if end is not None else s[start:].rstrip(_WS))


def scan_hermes(text: str, final: bool) -> Scan:
    first = text.find(TAG)
    if first < 0:
        if final:
            return Scan(text)
        held = next((k for k in range(len(TAG) - 1, 0, -1) if text.endswith(TAG[:k])), 0)
        return Scan(text[:len(text) - held])   # a "<tool_" that may become a tag is held back
    calls, pos = [], first
    while pos >= 0:
        body = pos + len(TAG)
        close = text.find(END_TAG, body)
        source, fields, end = text, *_object(text, body, final)   # an end tag inside a string stays in it
        if end is None and close >= 0:   # malformed: the block ends at its end tag
            source = text[body:close]
            fields, end = _object(source, 0, True)
            after = close + len(END_TAG)
        else:
            after = end
        call = _call(source, fields, end is not None, ("arguments", "parameters"))
        if call is not None:
            calls.append(call)
        pos = text.find(TAG, after) if after is not None else -1
    if final and not calls:
        return Scan(text)
    content = text[:first]
    return Scan(content if content.strip() else None, calls)


def scan_named(name: str, text: str, final: bool) -> Scan:
    return Scan(None, [ScannedCall(name, text if final else text.rstrip(_WS))])


def scan_required(text: str, final: bool) -> Scan:
    calls: list[ScannedCall] = []
    i = _skip(text, 0)
    if i >= len(text) or text[i] != "[":
        return Scan(None, calls)
    i += 1
    while True:
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i += 1
        fields, end = _object(text, i, final)
        call = _call(text, fields, end is not None, ("parameters",))
        if call is None:
            return Scan(None, calls)
        calls.append(call)
        if end is None:
            return Scan(None, calls)
        i = end


# --tool-call-parser NAME -> the scanner of the model's text under tool_choice auto
PARSERS = {"hermes": scan_hermes}
