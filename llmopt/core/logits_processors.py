"""The per-request logits processors of vLLM's SamplingParams, applied by the sampler before the
penalties (vLLM v1's order): min_tokens (EOS and stop ids at -inf until enough tokens are out),
`allowed_token_ids` (every other token at -inf), `bad_words` (a word's last token at -inf when the
output ends with the rest of it; a one-token word always) and `logit_bias` (added to the logits,
OpenAI's [-100, 100]). Logprobs stay those of the model's raw distribution, as vLLM's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:   # type only: the sampler imports this module
    from llmopt.core.sampler import SamplingRow


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's token ids as vLLM forms them: the word alone and after a space (the form it takes
    inside a sentence), without special tokens, each distinct sequence once."""
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer(text, add_special_tokens=False).input_ids)
            if ids and ids not in out:
                out.append(ids)
    return out


def needs_processing(row: "SamplingRow") -> bool:
    p = row.params
    return bool(row.blocked_token_ids) or bool(p.logit_bias) or p.allowed_token_ids is not None or bool(row.bad_words)


def apply_logits_processors(logits: torch.Tensor, rows: list["SamplingRow"]) -> torch.Tensor:
    """float32 logits [len(rows), vocab] with each row's blocked ids, allowed ids, bad words and bias
    applied."""
    todo = [i for i, r in enumerate(rows) if needs_processing(r)]
    if not todo:
        return logits
    logits = logits.clone()
    dev, vocab = logits.device, logits.shape[-1]
    for i in todo:
        p, row = rows[i].params, logits[i]
        if rows[i].blocked_token_ids:
            row[[t for t in sorted(rows[i].blocked_token_ids) if t < vocab]] = float("-inf")
        if p.allowed_token_ids is not None:
            keep = torch.zeros(vocab, dtype=torch.bool, device=dev)
            keep[torch.tensor(p.allowed_token_ids, device=dev)] = True
            row.masked_fill_(~keep, float("-inf"))
        out = rows[i].output_token_ids
        banned = [seq[-1] for seq in rows[i].bad_words
                  if len(seq) == 1 or (len(out) >= len(seq) - 1 and out[len(out) - len(seq) + 1:] == seq[:-1])]
        if banned:
            row[torch.tensor(banned, device=dev)] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=dev)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=dev))
    return logits
