"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a choice or a grammar
(vLLM's `StructuredOutputsParams`), with llguidance computing each step's token bitmask."""

from llmopt.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
