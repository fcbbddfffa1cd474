"""The grammar backend: llguidance matchers over the model's tokenizer, one per request.

Why llguidance (vLLM's `guidance` backend) and not xgrammar (vLLM's default): llguidance is one
dependency-free wheel of ~8 MB, where xgrammar's Linux wheel requires triton (~1 GB installed) and
a TVM FFI runtime on a CPU-only machine. llguidance also compiles lazily (a matcher is ready in
under a millisecond and computes each mask in tens of microseconds), so no grammar compile can
stall the step loop, and it rolls back (speculative drafts) and deep-copies (n > 1 forks).

`StructuredOutputManager(tokenizer, vocab_size, eos_token_ids)` builds llguidance's tokenizer once
(the engine, at its first structured request), compiles each distinct constraint once (cached)
and makes a `RequestGrammar` per request, a copy of the compiled matcher. A step
fills one bitmask row per sampled row (`RequestGrammar.fill`; draft rows by consuming the drafts and
rolling them back), the sampler masks the logits with it (`apply_bitmask`), and each accepted token
advances the matcher (`RequestGrammar.accept`)."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections import OrderedDict
from typing import Any, Sequence

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark
import torch

from llmopt.errors import UserInputError
from llmopt.structured.params import StructuredOutputsParams


class RequestGrammar:
    """One request's matcher: what it may emit next, advanced by its accepted tokens."""

    def __init__(self, matcher: "llguidance.LLMatcher", params: StructuredOutputsParams) -> None:
        self.matcher = matcher
        self.params = params

    def accept(self, token_ids: Sequence[int]) -> bool:
        """Advance over accepted tokens; False if one of them breaks the grammar (the matcher is
        then in its error state and masks nothing more)."""
        return all(self.matcher.consume_token(int(t)) for t in token_ids)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing further (EOS included, once consumed)."""
        return self.matcher.is_stopped()

    def fork(self) -> "RequestGrammar":
        return RequestGrammar(self.matcher.deep_copy(), self.params)

    def fill(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int] = ()) -> None:
        """Rows row .. row + len(drafts): the mask after the accepted tokens and the first j drafts.
        Drafts the grammar refuses leave the rows after them allowing everything (their draft is
        rejected by the masked row before it, so those rows are never used)."""
        _fill_row(self.matcher, bitmask, row)
        if not drafts:
            return
        ok = self.matcher.validate_tokens([int(d) for d in drafts])   # the longest valid prefix; no state change
        for j in range(1, ok + 1):
            self.matcher.consume_token(int(drafts[j - 1]))
            _fill_row(self.matcher, bitmask, row + j)
        bitmask[row + ok + 1:row + len(drafts) + 1] = -1
        if ok:
            self.matcher.rollback(ok)


class StructuredOutputManager:
    """llguidance's view of the model's tokenizer (built once: about half a second for a 49k
    vocabulary) and a matcher per request, copied from a compiled one kept per constraint (the
    last CACHE_SIZE constraints): a 40-field schema compiles in ~5.6 ms and copies in ~0.13 ms."""

    CACHE_SIZE = 256

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()   # requests are added from the server's loop and the engine's thread
        import llguidance.hf   # deferred: start-up time (it imports transformers' tokenizer classes)
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                          eos_token=sorted(eos_token_ids) or None)
        except (ValueError, TypeError, AttributeError) as e:
            raise UserInputError(f"structured outputs need a fast (Rust) Hugging Face tokenizer: {e}") from None

    def grammar(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher for `params` (its own state: a copy of the compiled one); an invalid
        schema, regex or grammar is a UserInputError naming the problem (e.g. an unclosed regex
        group, an unsupported schema keyword)."""
        key = json.dumps(dataclasses.asdict(params))   # key order kept: it orders the generated JSON
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
        if compiled is None:
            compiled = self._compile(params)
            with self._lock:
                self._compiled[key] = compiled
                while len(self._compiled) > self.CACHE_SIZE:
                    self._compiled.popitem(last=False)
        return RequestGrammar(compiled.deep_copy(), params)

    def _compile(self, params: StructuredOutputsParams) -> "llguidance.LLMatcher":
        try:
            matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(params), log_level=0)
        except (ValueError, TypeError, RuntimeError) as e:
            raise UserInputError(f"structured outputs: invalid {params.kind}: {_one_line(str(e))}") from None
        if matcher.is_error():
            raise UserInputError(f"structured outputs: invalid {params.kind}: {_one_line(matcher.get_error())}")
        return matcher

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return allocate_bitmask(rows, self.vocab_size)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32, every token allowed (bit t % 32 of word t // 32: token t)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def _fill_row(matcher: "llguidance.LLMatcher", bitmask: torch.Tensor, row: int) -> None:
    """The matcher's allowed next tokens into bitmask row `row` (a contiguous CPU int32 row).
    llguidance.torch has the same helper, but importing it compiles a kernel with torch.compile
    (triton and dynamo: ~6 s on every engine start, and an inductor compile at the first step)."""
    v = bitmask[row]
    matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON or Lark text) for `params`."""
    m = llguidance.LLMatcher
    if params.json is not None or params.json_object:
        schema = params.json if params.json is not None else {"type": "object"}
        if params.disable_additional_properties:
            schema = closed_schema(schema)
        return m.grammar_from_json_schema(json.dumps(schema),
                                          defaults={"whitespace_flexible": not params.disable_any_whitespace})
    if params.regex is not None:
        return m.grammar_from_regex(params.regex)
    if params.choice is not None:
        return m.grammar_from_regex("|".join(re.escape(c) for c in params.choice))
    text = params.grammar
    if "::=" in text:   # GBNF (llama.cpp); llguidance converts it to its Lark dialect
        text = gbnf_to_lark(text)
    return m.grammar_from_lark(text)


def closed_schema(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that does not say otherwise."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_schema(v) for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


# byte -> its 8 bits, lowest first: a little-endian int32 bitmask viewed as bytes unpacks in token order
_BITS_OF_BYTE = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set to -inf, in place, the logits of rows `rows` that their bitmask rows (same order) forbid;
    columns past the bitmask's vocabulary (padding of the logits) are forbidden too."""
    if not rows:
        return
    vocab = logits.shape[-1]
    allowed = _BITS_OF_BYTE[bitmask.contiguous().view(torch.uint8).int()].flatten(1)[:, :vocab]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    forbidden = ~allowed.to(logits.device)
    rows = list(rows)
    if rows == list(range(rows[0], rows[0] + len(rows))):   # a run of rows (the usual case): in place
        logits[rows[0]:rows[0] + len(rows)].masked_fill_(forbidden, float("-inf"))
    else:
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill(forbidden, float("-inf"))


def _one_line(text: str) -> str:
    """llguidance's multi-line report (message, source line, caret) as one line."""
    lines = [ln.strip() for ln in str(text).splitlines()]
    lines = [ln for ln in lines if ln and set(ln) != {"^"} and not ln.split("|")[0].strip().isdigit()]
    return "; ".join(lines)[:300]
