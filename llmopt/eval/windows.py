"""Which tokens each perplexity protocol feeds the model and which it scores.

A `Window` is one model input row: `ids`, and the contiguous run of positions
`start .. start + len(targets) - 1` whose next-token predictions are scored against `targets`.
`target_index` is where the targets begin in the token stream (for counting their bytes).

- `sliding`  — Hugging Face "Perplexity of fixed-length models": windows of `max_length` every
  `stride` tokens; only tokens not scored by an earlier window are scored (the overlap is context).
- `chunks`   — GPTQ / AWQ: non-overlapping `ctx` windows, the tail shorter than `ctx` dropped; every
  position but the first is scored (ctx − 1 per window).
- `llamacpp` — llama.cpp `perplexity`: `ctx` chunks (tail dropped, at least 2 chunks of tokens
  needed); with a BOS-adding tokenizer the first token of each chunk is replaced by BOS; each chunk
  scores its last ctx − 1 − ctx/2 predictions. A text file is tokenized as stored, line ends
  included, as `llama-perplexity -f FILE` reads it (ppl.plan_ppl).
- `rolling`  — lm-evaluation-harness `loglikelihood_rolling` (context_len=1): per document, the
  first window is prefix token + tokens[:L-1] scoring all L tokens; later windows score the next
  ≤ L tokens, each with a full L-token input (the earlier tokens as context).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.errors import DataError, UserInputError


@dataclass
class Window:
    ids: torch.Tensor        # [L] model input
    start: int               # first scored position in ids
    targets: torch.Tensor    # [n] tokens predicted by positions start .. start + n - 1
    target_index: int = -1   # index of targets[0] in the token stream (-1: not from one stream)
    doc: int = 0             # document index (rolling)


def sliding_windows(tokens: torch.Tensor, max_length: int, stride: int) -> list[Window]:
    if stride < 1 or max_length < 2 or stride > max_length:
        raise UserInputError(f"sliding needs 1 <= --stride <= --max-length and --max-length >= 2 "
                             f"(got stride {stride}, max-length {max_length})")
    n = len(tokens)
    if n < 2:
        raise DataError("sliding needs at least 2 tokens")
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + max_length, n)
        first_target = max(prev_end, begin + 1)  # position 0 of a window predicts nothing before it
        if first_target < end:
            out.append(Window(tokens[begin:end], first_target - 1 - begin, tokens[first_target:end], first_target))
        prev_end = end
        if end == n:
            break
    return out


def chunk_windows(tokens: torch.Tensor, ctx: int) -> list[Window]:
    if ctx < 2:
        raise UserInputError(f"--ctx must be at least 2 (got {ctx})")
    n_chunks = len(tokens) // ctx
    if n_chunks == 0:
        raise DataError(f"chunks needs at least --ctx {ctx} tokens, the text has {len(tokens)}")
    return [Window(tokens[i * ctx:(i + 1) * ctx], 0, tokens[i * ctx + 1:(i + 1) * ctx], i * ctx + 1)
            for i in range(n_chunks)]


def llamacpp_windows(tokens: torch.Tensor, ctx: int, bos_id: int | None) -> list[Window]:
    """`tokens` already start with BOS when the tokenizer adds one (llama.cpp tokenizes with add_bos)."""
    if ctx < 4:
        raise UserInputError(f"--ctx must be at least 4 for llamacpp (got {ctx})")
    if len(tokens) < 2 * ctx:
        raise DataError(f"llamacpp needs at least 2*ctx = {2 * ctx} tokens (as llama.cpp), the text has {len(tokens)}")
    first = ctx // 2
    out = []
    for i in range(len(tokens) // ctx):
        s = i * ctx
        ids = tokens[s:s + ctx]
        if bos_id is not None:
            ids = ids.clone()
            ids[0] = bos_id
        out.append(Window(ids, first, tokens[s + first + 1:s + ctx], s + first + 1))
    return out


def rolling_windows(tokens: list[int], prefix_token: int, max_length: int, doc: int = 0) -> list[Window]:
    """lm-eval's get_rolling_token_windows + make_disjoint_window + the left truncation of
    _loglikelihood_tokens, with context_len = 1."""
    if max_length < 1:
        raise UserInputError(f"--max-length must be positive (got {max_length})")
    if not tokens:
        return []
    t = torch.tensor(tokens, dtype=torch.long)
    n = len(tokens)
    first_len = min(max_length, n)
    ids = torch.cat([torch.tensor([prefix_token]), t[:first_len - 1]])
    out = [Window(ids, 0, t[:first_len], 0, doc)]
    predicted = first_len
    while predicted < n:
        pred_len = min(n - predicted, max_length)
        end = predicted + pred_len
        # context = tokens[end - L - 1 : end - 1] made disjoint, + continuation, left-truncated to
        # L + 1 tokens, last dropped: the input is tokens[end - L - 1 : end - 1] (L tokens).
        lo = end - max_length - 1
        ids = t[lo:end - 1]
        out.append(Window(ids, len(ids) - pred_len, t[predicted:end], predicted, doc))
        predicted = end
    return out
