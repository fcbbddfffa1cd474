"""Perplexity of a loaded model on a text, by one of four peer protocols (see windows.py), with
KL divergence against a base model computed in the same pass.

`plan_ppl` tokenizes and lays out the windows; `run_ppl` scores them and returns a `PplResult`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from llmopt import defaults
from llmopt.errors import DataError, UserInputError
from llmopt.eval.data import TextDataset, wikitext_detokenize, word_count
from llmopt.eval.score import PagedScoring, score_windows
from llmopt.eval.windows import (Window, chunk_windows, llamacpp_windows, rolling_windows,
                                 sliding_windows)

METHODS = ("sliding", "chunks", "rolling", "llamacpp")


@dataclass
class KLResult:
    base_model: str
    kld_mean: float
    kld_median: float
    kld_p99: float
    kld_max: float
    top1_agreement: float
    base_ppl: float


@dataclass
class PplResult:
    model: str
    dataset: str
    method: str
    ppl: float
    mean_nll: float
    scored_tokens: int
    bits_per_byte: float
    tokens_per_s: float            # model input tokens (context included) per second of scoring
    seconds: float
    input_tokens: int
    windows: int
    window: int                    # --ctx (chunks, llamacpp) or --max-length (sliding, rolling)
    stride: int | None
    batch_size: int
    dtype: str
    device: str
    scored_bytes: int
    documents: int | None = None           # rolling: lm-evaluation-harness wikitext metrics
    word_perplexity: float | None = None
    byte_perplexity: float | None = None
    words: int | None = None
    kl: KLResult | None = None
    kv_cache_dtype: str | None = None      # scored through the engine's paged cache of this dtype


@dataclass
class PplPlan:
    method: str
    dataset: str
    windows: list[Window]
    window: int
    stride: int | None
    token_bytes_cumsum: torch.Tensor | None = None   # stream methods: bytes of tokens [0, i)
    doc_words: list[int] = field(default_factory=list)
    doc_bytes: list[int] = field(default_factory=list)


def _stream(tokenizer, text: str, limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the whole text (special tokens as the tokenizer adds them, as the peers encode
    it) and the cumulative UTF-8 bytes each token covers."""
    if limit is not None:
        if limit < 2:
            raise UserInputError(f"--limit must be at least 2 tokens (got {limit})")
        text = _prefix_for(tokenizer, text, limit)
    try:
        enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True, verbose=False)
        starts = [s for s, _ in enc["offset_mapping"]]
        ids = enc["input_ids"]
    except (NotImplementedError, TypeError, ValueError):  # slow tokenizers have no offsets
        ids, starts = tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"], None
    if limit is not None:
        ids = ids[:limit]
    if starts is not None:
        bounds = starts[:len(ids)] + [starts[len(ids)] if len(ids) < len(starts) else len(text)]
        nbytes = [len(text[bounds[i]:bounds[i + 1]].encode("utf-8")) for i in range(len(ids))]
    else:
        nbytes = [len(tokenizer.decode([t]).encode("utf-8")) for t in ids]
    cum = torch.zeros(len(ids) + 1, dtype=torch.long)
    cum[1:] = torch.tensor(nbytes, dtype=torch.long).cumsum(0)
    return torch.tensor(ids, dtype=torch.long), cum


def _prefix_for(tokenizer, text: str, limit: int, margin: int = 64) -> str:
    """A prefix of `text`, cut at a line end, whose tokens include the first `limit` tokens of the
    whole text unchanged (tokenizing 1 MB to keep 4k tokens is slow)."""
    n = max(4096, 8 * (limit + margin))
    while n < len(text):
        cut = text.rfind("\n", 0, n) + 1 or n
        if len(tokenizer(text[:cut], add_special_tokens=True, verbose=False)["input_ids"]) >= limit + margin:
            return text[:cut]
        n *= 2
    return text


def adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    return len(with_special) > len(tokenizer("a", add_special_tokens=False)["input_ids"]) and with_special[0] == bos


def plan_ppl(tokenizer, max_position_embeddings: int, data: TextDataset, method: str = defaults.PPL_METHOD,
             ctx: int | None = None, max_length: int | None = None, stride: int | None = None,
             limit: int | None = None) -> PplPlan:
    if method not in METHODS:
        raise UserInputError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
    if tokenizer is None:
        raise UserInputError("perplexity needs the model's tokenizer")
    for flag, value in (("--ctx", ctx), ("--max-length", max_length)):
        if value is not None and value > max_position_embeddings:   # positions the model never saw
            raise UserInputError(f"{flag} {value:,} is longer than the model's context of "
                                 f"{max_position_embeddings:,} tokens: give at most that")
    if method == "rolling":
        return _plan_rolling(tokenizer, data, max_length or ctx or max_position_embeddings, limit)
    # llama-perplexity tokenizes a file's bytes: its line ends as stored (WikiText-2 raw's CRLF kept)
    as_read = data.as_stored if method == "llamacpp" and data.as_stored is not None else data.text
    tokens, cum = _stream(tokenizer, as_read, limit)
    if method == "chunks":
        window, stride = ctx or defaults.PPL_CTX, None
        wins = chunk_windows(tokens, window)
    elif method == "llamacpp":
        window, stride = ctx or defaults.PPL_LLAMACPP_CTX, None
        wins = llamacpp_windows(tokens, window, tokenizer.bos_token_id if adds_bos(tokenizer) else None)
    else:
        window, stride = max_length or ctx or defaults.PPL_CTX, stride or defaults.PPL_STRIDE
        wins = sliding_windows(tokens, window, stride)
    return PplPlan(method, data.name, wins, window, stride, token_bytes_cumsum=cum)


def _plan_rolling(tokenizer, data: TextDataset, max_length: int, limit: int | None) -> PplPlan:
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if prefix is None:
        raise UserInputError("rolling needs a BOS or EOS token to prefix each document; the tokenizer has neither")
    plan = PplPlan("rolling", data.name, [], max_length, None)
    total = 0
    for page in data.documents:
        ids = tokenizer(wikitext_detokenize(page), add_special_tokens=False, verbose=False)["input_ids"]
        if limit is not None and plan.doc_words and total + len(ids) > limit:
            break
        total += len(ids)
        plan.windows += rolling_windows(ids, prefix, max_length, doc=len(plan.doc_words))
        plan.doc_words.append(word_count(page))
        plan.doc_bytes.append(len(page.encode("utf-8")))
    if not plan.windows:
        raise DataError(f"{data.name}: no tokens to score")
    return plan


def check_same_vocab(lm, base) -> None:
    if lm.config.vocab_size != base.config.vocab_size:
        raise UserInputError(f"--base-model has vocab size {base.config.vocab_size}, the model {lm.config.vocab_size}: "
                             "KL divergence needs the same tokenizer")
    if lm.tokenizer is not None and base.tokenizer is not None and lm.tokenizer.get_vocab() != base.tokenizer.get_vocab():
        raise UserInputError("--base-model uses a different tokenizer vocabulary: KL divergence needs the same tokenizer")


def run_ppl(lm, plan: PplPlan, batch_size: int = defaults.PPL_BATCH_SIZE, base=None, progress=None,
            kv_cache_dtype: str | None = None) -> PplResult:
    """kv_cache_dtype: score through the engine's runner, its paged KV cache in this dtype (each
    position attends over the cached K/V of the window so far), and the base (if any) through its
    own runner with a float32 cache; None: dense attention, no cache."""
    if batch_size < 1:
        raise UserInputError(f"--batch-size must be at least 1 (got {batch_size})")
    if base is not None:
        check_same_vocab(lm, base)
    paged = base_paged = None
    if kv_cache_dtype is not None:
        paged = PagedScoring(lm, kv_cache_dtype, plan.windows, batch_size)
        if base is not None:   # the base through a float32 cache on the same path: the KL is the cache's
            base_paged = PagedScoring(base, "float32", plan.windows, batch_size)
    t0 = time.perf_counter()
    s = score_windows(lm.model, plan.windows, batch_size, lm.device,
                      base=base.model if base is not None else None, progress=progress, paged=paged,
                      base_paged=base_paged)
    seconds = time.perf_counter() - t0
    nll, count = sum(s.window_nll), sum(s.window_count)
    res = PplResult(
        model=lm.source, dataset=plan.dataset, method=plan.method, ppl=math.exp(nll / count),
        mean_nll=nll / count, scored_tokens=count, bits_per_byte=float("nan"),
        tokens_per_s=s.input_tokens / seconds if seconds > 0 else float("inf"), seconds=seconds,
        input_tokens=s.input_tokens, windows=len(plan.windows), window=plan.window, stride=plan.stride,
        batch_size=batch_size, dtype=str(lm.dtype).replace("torch.", ""), device=str(lm.device), scored_bytes=0,
        kv_cache_dtype=paged.kv_dtype if paged is not None else None)
    if plan.method == "rolling":
        words, nbytes = sum(plan.doc_words), sum(plan.doc_bytes)
        res.documents, res.words, res.scored_bytes = len(plan.doc_words), words, nbytes
        res.word_perplexity = math.exp(nll / words)
        res.byte_perplexity = math.exp(nll / nbytes)
    else:
        cum = plan.token_bytes_cumsum
        res.scored_bytes = int(sum(int(cum[w.target_index + len(w.targets)] - cum[w.target_index])
                                   for w in plan.windows))
    if res.scored_bytes:
        res.bits_per_byte = nll / res.scored_bytes / math.log(2)
    if base is not None:
        kl = torch.cat(s.kl).double()
        res.kl = KLResult(base_model=base.source, kld_mean=float(kl.mean()), kld_median=float(kl.median()),
                          kld_p99=float(torch.quantile(kl, 0.99)) if len(kl) <= 16_000_000 else
                          float(kl.sort().values[int(0.99 * (len(kl) - 1))]),
                          kld_max=float(kl.max()), top1_agreement=s.agree / count,
                          base_ppl=math.exp(s.base_nll / count))
    return res
