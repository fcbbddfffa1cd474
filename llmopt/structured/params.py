"""StructuredOutputsParams: what a request's output must match, with vLLM's field names.

Exactly one of `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice` (the output is
one of these strings), `grammar` (a Lark grammar, or GBNF as llama.cpp writes it: rules with `::=`)
or `json_object` (any JSON object: OpenAI's `response_format: {"type": "json_object"}`).
Pure Python (no grammar library): this checks the shape; whether a schema, regex or grammar
compiles is checked by `structured.backend` when the engine builds the request's matcher, with the
same one-line errors."""

from __future__ import annotations

import json
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


def _schema(value: Any) -> dict | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UserInputError(f"structured outputs: the JSON schema is not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, (dict, bool)):
        raise UserInputError(f"structured outputs: a JSON schema is an object, got {type(value).__name__}")
    return value
