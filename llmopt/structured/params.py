"""StructuredOutputsParams: what a request's output must match, with vLLM's field names.

Exactly one of `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice` (the output is
one of these strings), `grammar` (a Lark grammar, or GBNF as llama.cpp writes it: rules with `::=`)
or `json_object` (any JSON object: OpenAI's `response_format: {"type": "json_object"}`).
`grammar_text()` turns it into the llguidance grammar the matcher runs. No llguidance at import
time: the check of the shape is pure Python; whether a schema or a regex compiles is checked by
`structured.backend.check_grammar`, with the same one-line errors."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from llmopt.errors import UserInputError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: Any = None                   # a JSON schema: dict, or its JSON text
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None         # Lark (llguidance's dialect) or GBNF
    json_object: bool = False
    disable_additional_properties: bool = False   # vLLM: treat a schema's objects as closed
    disable_any_whitespace: bool = False          # vLLM: compact JSON (no whitespace between tokens)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = ", ".join(given) if given else "none"
            raise UserInputError(f"structured outputs: give exactly one of {', '.join(KINDS)} (got {what})")
        if self.json is not None:
            object.__setattr__(self, "json", _schema(self.json))
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise UserInputError("structured outputs: regex must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise UserInputError("structured outputs: choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise UserInputError("structured outputs: grammar must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON or Lark text) for this constraint."""
        import llguidance   # deferred: only requests with structured outputs need the grammar library
        m = llguidance.LLMatcher
        if self.json is not None or self.json_object:
            schema = self.json if self.json is not None else {"type": "object"}
            if self.disable_additional_properties:
                schema = _closed(schema)
            return m.grammar_from_json_schema(json.dumps(schema),
                                              defaults={"whitespace_flexible": not self.disable_any_whitespace})
        if self.regex is not None:
            return m.grammar_from_regex(self.regex)
        if self.choice is not None:
            return m.grammar_from_regex("|".join(re.escape(c) for c in self.choice))
        text = self.grammar
        if "::=" in text:   # GBNF (llama.cpp); llguidance converts it to its Lark dialect
            from llguidance.gbnf_to_lark import gbnf_to_lark   # deferred: as above
            text = gbnf_to_lark(text)
        return m.grammar_from_lark(text)


def _schema(value: Any) -> dict | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UserInputError(f"structured outputs: the JSON schema is not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, (dict, bool)):
        raise UserInputError(f"structured outputs: a JSON schema is an object, got {type(value).__name__}")
    return value


def _closed(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that does not say otherwise."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
