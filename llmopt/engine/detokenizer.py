"""Incremental detokenization, per request: it only builds text (stop strings are checked by
llmopt.core.stop.check_stop, which searches this text).

Text grows by decoding a short window of recent tokens twice (with and without the newest ones)
and keeping the difference, so each step costs a few tokens' decoding, not the whole output; an
unfinished UTF-8 sequence (a trailing U+FFFD) waits for the next token."""

from __future__ import annotations

PROMPT_CONTEXT = 5  # prompt tokens decoded before the first output token (leading spaces, merges)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.tokens = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the text they added to `self.text` ("" while a character is unfinished)."""
        self.tokens.extend(token_ids)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return delta
