"""Batched sampling: one call per step for every row that samples, whatever each row asks for.

Order, as in vLLM: the logits processors (min_tokens masking, allowed_token_ids, bad_words,
logit_bias: logits_processors.py), penalties (repetition on prompt + output, presence and
frequency on the output), then greedy argmax or temperature -> top-k -> top-p -> min-p -> a draw.
Draws use the exponential race (argmax of p / E with E ~ Exp(1)), which samples exactly from p and
lets each seeded row take its noise from its own torch.Generator, so a seeded request gets the same
tokens whatever else is in the batch. Logprobs are those of the model's raw distribution.

Speculative decoding: a request verifying k draft tokens has k + 1 rows, and row j is sampled as if
the first j drafts had been accepted (penalties count them, min_tokens blocks EOS until they reach
it). Greedy rows take the argmax (the scheduler keeps drafts while they equal it); sampled rows go
through exact rejection sampling (`rejection_sample`): draft j is accepted with probability
min(1, p_j(d) / q_j(d)), a rejected one is replaced by a draw from norm(max(0, p_j - q_j)), and
after k accepted drafts a bonus token is drawn from p_k. A drafter that drafts greedily passes no q
(one-hot q), as vLLM's n-gram and EAGLE proposers do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmopt.core.logits_processors import apply_logits_processors, needs_processing
from llmopt.core.sampling_params import SamplingParams
from llmopt.structured.backend import allocate_bitmask, apply_bitmask


@dataclass
class SamplingRow:
    """One row of logits to sample from, and the context its penalties look at."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    blocked_token_ids: frozenset[int] = frozenset()  # EOS/stop ids while min_tokens is not reached
    bad_words: list[list[int]] = field(default_factory=list)  # SamplingParams.bad_words as token ids


@dataclass
class SampledTokens:
    """One request's tokens from one step: row j was sampled after its tokens and its first j
    draft tokens (one row without drafts). Logprobs where the request asked for them."""
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None

    def logprob(self, j: int) -> float | None:
        return self.logprobs[j] if self.logprobs is not None else None

    def top(self, j: int) -> dict[int, float] | None:
        return dict(zip(self.top_ids[j], self.top_logprobs[j])) if self.top_ids is not None else None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None = None           # of the sampled tokens
    top_ids: list[list[int]] | None = None        # [rows][k], best first
    top_logprobs: list[list[float]] | None = None
    probs: torch.Tensor | None = None             # [rows, vocab]: the distribution each row samples from
                                                  # (after penalties, temperature, top-k/p, min-p; greedy
                                                  # rows: softmax of the penalized logits), when asked


def _pad(rows: list[list[int]], fill: int, device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (HF: divide positive logits, multiply negative ones, for tokens in the prompt or
    output), then frequency and presence (OpenAI: minus f * count + p * [count > 0] on the output)."""
    idx = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not idx:
        return logits
    B, V = logits.shape
    dev = logits.device
    sub = logits[idx]
    out_ids = _pad([rows[i].output_token_ids for i in idx], V, dev)
    counts = torch.zeros(len(idx), V + 1, device=dev, dtype=sub.dtype)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=sub.dtype))
    counts = counts[:, :V]
    rep = torch.tensor([rows[i].params.repetition_penalty for i in idx], device=dev, dtype=sub.dtype)[:, None]
    if bool((rep != 1).any()):
        seen = torch.zeros(len(idx), V + 1, dtype=torch.bool, device=dev)
        seen.scatter_(1, _pad([rows[i].prompt_token_ids for i in idx], V, dev), True)
        seen = seen[:, :V] | (counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([rows[i].params.frequency_penalty for i in idx], device=dev, dtype=sub.dtype)[:, None]
    pres = torch.tensor([rows[i].params.presence_penalty for i in idx], device=dev, dtype=sub.dtype)[:, None]
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    logits = logits.clone()
    logits[idx] = sub
    return logits


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                  min_p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf what top-k (k per row, 0 = off), top-p and min-p exclude. Rows already scaled by
    temperature. top-p keeps the smallest set of top tokens whose mass reaches p."""
    neg = torch.finfo(logits.dtype).min
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if top_k is not None:
            ranks = torch.arange(logits.shape[-1], device=logits.device)
            k = torch.where(top_k > 0, top_k, logits.shape[-1])
            sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], neg)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly above each token
        sorted_logits = sorted_logits.masked_fill(before >= top_p[:, None], neg)
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    elif top_k is not None:
        kmax = int(top_k.max())
        kth = logits.topk(kmax, dim=-1).values.gather(-1, (top_k.clamp(min=1) - 1)[:, None])
        kth = torch.where(top_k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
        logits = logits.masked_fill(logits < kth, neg)
    if min_p is not None:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), neg)
    return logits


def _grammar_first(raw: torch.Tensor, logits: torch.Tensor, rows: list[SamplingRow], bitmask: torch.Tensor,
                   grammar_rows: list[int]) -> None:
    """In place: a grammar row that the logits processors left with no allowed token (min_tokens
    blocking the EOS a complete grammar needs, allowed_token_ids or bad_words outside it) gets the
    grammar's mask alone, then the penalties: an output that keeps the grammar wins over them.
    Only rows with logits processors can be emptied (penalties and bias stay finite)."""
    js = [j for j, i in enumerate(grammar_rows)
          if needs_processing(rows[i]) and bool(torch.isneginf(logits[i]).all())]
    if not js:
        return
    idx = torch.tensor([grammar_rows[j] for j in js], device=logits.device)
    sub = raw[idx].float().clone()
    apply_bitmask(sub, bitmask[js], range(len(js)))
    logits[idx] = apply_penalties(sub, [rows[grammar_rows[j]] for j in js])


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], return_probs: bool = False,
                 grammar_mask: tuple[torch.Tensor, list[int]] | None = None) -> SamplerOutput:
        """logits [len(rows), vocab] -> one token per row (and logprobs where asked; with
        return_probs, each row's target distribution in `probs`). `grammar_mask` (bitmask, rows):
        structured outputs' allowed tokens for those rows, applied before the penalties; logprobs
        stay those of the model's raw distribution, as vLLM's."""
        raw = logits
        if grammar_mask is not None:
            logits = logits.float().clone()
            apply_bitmask(logits, *grammar_mask)
        logits = self._penalized(logits, rows)
        if grammar_mask is not None:
            _grammar_first(raw, logits, rows, *grammar_mask)
        greedy = [r.params.greedy for r in rows]
        probs = None
        if all(greedy):
            tokens = logits.argmax(-1)
            if return_probs:
                probs = logits.softmax(-1)
        else:
            probs = self.target_probs(logits, rows, greedy)
            tokens = self._draw(probs, rows, logits, greedy)
        out = self._with_logprobs(raw, tokens, rows)
        out.probs = probs if return_probs else None
        return out

    @staticmethod
    def _penalized(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """float32 logits with the logits processors (min_tokens' blocked ids, allowed ids, bad
        words, logit bias) and the penalties applied."""
        return apply_penalties(apply_logits_processors(logits.float(), rows), rows)

    def sample_scheduled(self, logits: torch.Tensor, scheduled, requests,
                         draft_probs: dict[str, torch.Tensor] | None = None) -> dict[str, SampledTokens]:
        """Sample every row the runner computed logits for (`ScheduledRequest.num_logits` rows per
        request, in schedule order) with each request's own parameters; the siblings in `fork_ids`
        sample from their leader's first row (the prompt's last position). A request verifying
        drafts (`spec_token_ids`) has one row per draft plus one: row j sees the first j drafts as
        outputs, and its token is the draft itself when rejection sampling accepts it (greedy: when
        it is the argmax), so the scheduler keeps drafts while they equal the row's token.
        `draft_probs[request_id]` [k, vocab] is the drafter's q (absent: the drafts were greedy).
        Keyed by request id."""
        rows: list[SamplingRow] = []
        index: list[int] = []
        owners: list[tuple[str, int, int]] = []   # request id, first row in `rows`, number of rows
        drafted: dict[str, list[int]] = {}           # request id -> the drafts its rows verify
        verify: list[tuple[str, int, list[int]]] = []  # sampled (not greedy) requests with drafts
        off = 0
        for s in scheduled:
            if not s.num_logits:
                continue
            for rid, first, m in [(s.request_id, off, s.num_logits)] + [(f, off, 1) for f in s.fork_ids]:
                req = requests[rid]
                drafts = list(s.spec_token_ids)[:m - 1] if rid == s.request_id else []
                owners.append((rid, len(rows), m))
                drafted[rid] = drafts
                if drafts and not req.params.greedy:
                    verify.append((rid, len(rows), drafts))
                rows.extend(_rows_with_drafts(req, drafts, m))
                index.extend(range(first, first + m))
            off += s.num_logits
        if not rows:
            return {}
        picked = logits if index == list(range(logits.shape[0])) else logits[torch.tensor(index, device=logits.device)]
        res = self(picked, rows, return_probs=bool(verify), grammar_mask=_grammar_mask(owners, requests, drafted, picked))
        tokens = res.token_ids
        if verify:
            tokens = list(tokens)
            for rid, a, drafts in verify:
                k = len(drafts)
                q = None if draft_probs is None or rid not in draft_probs else draft_probs[rid][None, :k]
                gen = rows[a].generator
                got = rejection_sample(res.probs[None, a:a + k + 1], torch.tensor([drafts], device=res.probs.device),
                                       q, gen if gen is not None else self.generator)
                tokens[a:a + k + 1] = got[0].tolist()
            if res.logprobs is not None:   # logprobs of the tokens rejection sampling chose
                res = self._with_logprobs(picked, torch.tensor(tokens, device=picked.device), rows)

        def part(xs, a, m):
            return None if xs is None else xs[a:a + m]
        return {rid: SampledTokens(tokens[a:a + m], part(res.logprobs, a, m), part(res.top_ids, a, m),
                                   part(res.top_logprobs, a, m)) for rid, a, m in owners}

    def target_probs(self, logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]) -> torch.Tensor:
        """Each row's distribution: temperature, top-k, top-p, min-p on penalized logits (greedy
        rows at temperature 1, unfiltered)."""
        dev = logits.device
        temp = torch.tensor([1.0 if g else r.params.temperature for g, r in zip(greedy, rows)], device=dev)
        scaled = logits / temp[:, None]
        top_k = top_p = min_p = None
        if any(r.params.top_k > 0 and not g for r, g in zip(rows, greedy)):
            top_k = torch.tensor([0 if g else r.params.top_k for r, g in zip(rows, greedy)], device=dev)
        if any(r.params.top_p < 1 and not g for r, g in zip(rows, greedy)):
            top_p = torch.tensor([1.0 if g else r.params.top_p for r, g in zip(rows, greedy)], device=dev)
        if any(r.params.min_p > 0 and not g for r, g in zip(rows, greedy)):
            min_p = torch.tensor([0.0 if g else r.params.min_p for r, g in zip(rows, greedy)], device=dev)
        return filter_logits(scaled, top_k, top_p, min_p).softmax(-1)

    def _draw(self, probs: torch.Tensor, rows: list[SamplingRow], logits: torch.Tensor,
              greedy: list[bool]) -> torch.Tensor:
        dev = probs.device
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if len(unseeded) == len(rows):
            noise.exponential_(generator=self.generator if dev.type == "cpu" else None)
        else:
            if unseeded:
                noise[unseeded] = torch.empty(len(unseeded), probs.shape[-1], device=dev).exponential_(
                    generator=self.generator if dev.type == "cpu" else None)
            for i, r in enumerate(rows):
                if r.generator is not None:  # a CPU generator: draw there, then move
                    noise[i] = torch.empty(probs.shape[-1]).exponential_(generator=r.generator).to(dev)
        sampled = (probs / noise).argmax(-1)
        if any(greedy):
            g = torch.tensor(greedy, device=dev)
            sampled = torch.where(g, logits.argmax(-1), sampled)
        return sampled

    def _with_logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        out = SamplerOutput(tokens.tolist())
        want = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        if not want:
            return out
        lp = raw.float().log_softmax(-1)
        out.logprobs = lp.gather(-1, tokens[:, None])[:, 0].tolist()
        k = max(want)
        if k > 0:
            top = lp.topk(k, dim=-1)
            ids, vals = top.indices.tolist(), top.values.tolist()
            out.top_ids = [ids[i][:r.params.logprobs or 0] for i, r in enumerate(rows)]
            out.top_logprobs = [vals[i][:r.params.logprobs or 0] for i, r in enumerate(rows)]
        return out


def _grammar_mask(owners, requests, drafted: dict[str, list[int]], logits: torch.Tensor):
    """The structured-output bitmask of the rows whose request has a grammar (row j of a request
    verifying drafts: after its first j drafts), and those rows; None when no row has one."""
    constrained = [(requests[rid], a, m) for rid, a, m in owners if requests[rid].grammar is not None]
    if not constrained:
        return None
    bitmask = allocate_bitmask(sum(m for _, _, m in constrained), logits.shape[-1])
    rows: list[int] = []
    for req, a, m in constrained:
        drafts = drafted[req.request_id][:m - 1]
        first = len(rows)
        req.grammar.fill(bitmask, first, drafts)
        bitmask[first + len(drafts) + 1:first + m] = bitmask[first + len(drafts)]   # rows without a draft of their own
        rows.extend(range(a, a + m))
    return bitmask, rows


def _rows_with_drafts(req, drafts: list[int], m: int) -> list[SamplingRow]:
    """m rows for one request: row j has the first j drafts appended to its outputs, and blocks EOS
    and stop ids while those outputs are fewer than min_tokens."""
    if not drafts:
        return [SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids, req.generator,
                            req.blocked_token_ids, req.bad_words)] * m
    out = []
    n = len(req.output_token_ids)
    for j in range(m):
        blocked = req.eos_token_ids | req.stop_token_ids if n + j < req.params.min_tokens else frozenset()
        out.append(SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids + drafts[:j], req.generator,
                               blocked, req.bad_words))
    return out


def _exp_race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of `probs` (any leading shape; rows need not be normalized)."""
    noise = torch.empty(probs.shape, device="cpu").exponential_(generator=generator).to(probs.device)
    return (probs / noise).argmax(-1)


def rejection_sample(target_probs: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Exact speculative sampling (Leviathan et al., Chen et al.) for B sequences of k drafts.

    target_probs [B, k + 1, V]: the target's distribution at each verified row (row j after the first
    j drafts); draft_ids [B, k]; draft_probs [B, k, V] the distributions the drafts were drawn from,
    or None for drafts chosen deterministically (one-hot q). Returns tokens [B, k + 1]: position j
    holds draft j where it is accepted (probability min(1, p/q)), else a draw from
    norm(max(0, p - q)); position k a bonus draw from p_k. A sequence's output is its tokens up to and
    including the first that differs from its draft (all k + 1 when every draft is accepted), and is
    distributed exactly as sampling from the target one token at a time."""
    B, k1, V = target_probs.shape
    k = k1 - 1
    p = target_probs[:, :k].float()
    d = draft_ids.long()[..., None]
    p_d = p.gather(-1, d)[..., 0]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
        resid = p.scatter(-1, d, 0.0)
    else:
        q = draft_probs.float()
        q_d = q.gather(-1, d)[..., 0]
        resid = (p - q).clamp_min(0)
    u = torch.rand(B, k, generator=generator).to(p.device)
    accept = u * q_d < p_d                     # u < p/q without dividing by a zero q
    total = resid.sum(-1, keepdim=True)
    resid = torch.where(total > 0, resid, p)   # p == q: a rejection has probability 0 anyway
    recovered = _exp_race(resid, generator)
    bonus = _exp_race(target_probs[:, k].float(), generator)
    tokens = torch.where(accept, draft_ids.long(), recovered)
    return torch.cat([tokens, bonus[:, None]], 1)
