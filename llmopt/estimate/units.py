"""The size and token-count parsers live in `llmopt.units` (one parser for every command); this
name stays importable for the estimate package's callers."""

from llmopt.units import GIB, parse_bytes, parse_list, parse_tokens

__all__ = ["GIB", "parse_bytes", "parse_list", "parse_tokens"]
