"""Incremental detokenization and stop strings, per request.

Text grows by decoding a short window of recent tokens twice (with and without the newest ones)
and keeping the difference, so each step costs a few tokens' decoding, not the whole output; an
unfinished UTF-8 sequence (a trailing U+FFFD) waits for the next token."""

from __future__ import annotations

PROMPT_CONTEXT = 5  # prompt tokens decoded before the first output token (leading spaces, merges)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.tokens = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def add(self, token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string that ended the text, if one did."""
        self.tokens.extend(token_ids)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        if not self.stop:
            return None
        search_from = max(0, len(self.text) - len(delta) - self.max_stop_len + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        return s
