"""The grammar backend: llguidance matchers over the model's tokenizer, one per request.

Why llguidance (vLLM's `guidance` backend) and not xgrammar (vLLM's default): llguidance is one
dependency-free wheel of ~8 MB, where xgrammar's Linux wheel requires triton (~1 GB installed) and
a TVM FFI runtime on a CPU-only machine. llguidance also compiles lazily (a matcher is ready in
under a millisecond and computes each mask in tens of microseconds), so no grammar compile can
stall the step loop, and it rolls back (speculative drafts) and deep-copies (n > 1 forks).

`StructuredOutputManager(tokenizer, vocab_size, eos_token_ids)` builds llguidance's tokenizer once,
in a background thread (about a second for a 49k vocabulary), and makes a `RequestGrammar` per
request. A step fills one bitmask row per sampled row (`fill_bitmask`), the sampler masks the
logits with it (`apply_bitmask`), and the tokens the scheduler accepts advance the matcher
(`RequestGrammar.accept`). Draft rows are filled by consuming the drafts and rolling them back."""

from __future__ import annotations

import threading
from typing import Sequence

import llguidance
import llguidance.hf
import llguidance.torch
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
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)
        if not drafts:
            return
        ok = self.matcher.validate_tokens([int(d) for d in drafts])   # the longest valid prefix; no state change
        for j in range(1, ok + 1):
            self.matcher.consume_token(int(drafts[j - 1]))
            llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row + j)
        bitmask[row + ok + 1:row + len(drafts) + 1] = -1
        if ok:
            self.matcher.rollback(ok)


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self._lltok = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        eos = sorted(eos_token_ids)
        threading.Thread(target=self._build, args=(tokenizer, eos), name="llmopt-grammar-tokenizer", daemon=True).start()

    def _build(self, tokenizer, eos: list[int]) -> None:
        try:
            self._lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=eos or None)
        except BaseException as e:   # re-raised in the thread that asks for a grammar
            self._error = e
        finally:
            self._ready.set()

    @property
    def tokenizer(self) -> "llguidance.LLTokenizer":
        self._ready.wait()
        if self._error is not None:
            raise UserInputError(f"structured outputs need a fast (Rust) Hugging Face tokenizer: {self._error}")
        return self._lltok

    def grammar(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher for `params`; an invalid schema, regex or grammar is a UserInputError."""
        text = check_grammar(params, self.tokenizer)
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise UserInputError(f"structured outputs: {_one_line(matcher.get_error())}")
        return RequestGrammar(matcher, params)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return allocate_bitmask(rows, self.vocab_size)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32, every token allowed."""
    return llguidance.torch.allocate_token_bitmask(rows, vocab_size)


def check_grammar(params: StructuredOutputsParams, tokenizer=None) -> str:
    """The grammar text for `params`, after llguidance's own check (a UserInputError naming the
    problem, e.g. an unclosed regex group or an unsupported schema keyword)."""
    try:
        text = params.grammar_text()
    except (ValueError, TypeError, RuntimeError) as e:
        raise UserInputError(f"structured outputs: invalid {params.kind}: {_one_line(str(e))}") from None
    problem = llguidance.LLMatcher.validate_grammar(text, tokenizer)
    if problem:
        raise UserInputError(f"structured outputs: invalid {params.kind}: {_one_line(problem)}")
    return text


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set to -inf, in place, the logits of rows `rows` that their bitmask rows (same order) forbid."""
    if not rows:
        return
    idx = torch.tensor(list(rows), device=logits.device)
    sub = logits[idx].float()
    llguidance.torch.apply_token_bitmask_inplace(sub, bitmask.to(logits.device))
    logits[idx] = sub.to(logits.dtype)


def _one_line(text: str) -> str:
    """llguidance's multi-line report (message, source line, caret) as one line."""
    lines = [ln.strip() for ln in str(text).splitlines()]
    lines = [ln for ln in lines if ln and set(ln) != {"^"} and not ln.split("|")[0].strip().isdigit()]
    return "; ".join(lines)[:300]
