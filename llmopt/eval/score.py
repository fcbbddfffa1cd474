"""Run windows through the model and score them: batched forward (the last decoder layer only from
the first scored position on), logits only for the scored positions, computed
`defaults.LOSS_CHUNK_TOKENS` rows at a time (a chunked cross-entropy: never a full float32
[tokens, vocab] logits tensor for a window). Optionally the same rows through a base model, for KL
divergence and top-1 agreement in the same pass.

With a `PagedScoring` the windows run through the engine's runner instead, as prompts of one step:
their K/V written into its paged cache of the asked dtype and read back from it by every later
position (the C++ decode layers on the CPU), the logits of the scored positions returned. A kivi2
cache is read as KIVI decodes: the windows advance one group of G tokens a step, the engine's KV
manager quantizing between steps the groups that leave the last R tokens (within a group the
quantized prefix is the same for every position, so this is token-by-token decoding's cache)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from llmopt import defaults, kernels
from llmopt.cache.kivi import KiviConfig, page_bytes, request_blocks
from llmopt.cache.kv_manager import KVCacheManager
from llmopt.core.scheduler import ScheduledRequest, SchedulerOutput
from llmopt.errors import LLMOptError
from llmopt.eval.windows import Window
from llmopt.models.logprobs import score_tokens
from llmopt.models.attention import DenseCausalAttention


@dataclass
class Scores:
    window_nll: list[float] = field(default_factory=list)  # per window (in input order), float64 sums
    window_count: list[int] = field(default_factory=list)
    input_tokens: int = 0
    kl: list[torch.Tensor] = field(default_factory=list)    # per-token KL(base || model), float32
    agree: int = 0
    base_nll: float = 0.0


def batches(windows: Sequence[Window], batch_size: int) -> list[list[int]]:
    """Window indices grouped into batches of similar length (longest first, as lm-eval does)."""
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i].ids))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _hidden_rows(model, wins: list[Window], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward a right-padded batch; return hidden states of the scored positions and their targets."""
    L = max(len(w.ids) for w in wins)
    ids = torch.zeros(len(wins), L, dtype=torch.long)
    for b, w in enumerate(wins):
        ids[b, :len(w.ids)] = w.ids  # right padding never reaches earlier positions (causal)
    ids = ids.to(device)
    pos = torch.arange(L, device=device).expand(len(wins), L)
    s = min(w.start for w in wins)   # the first scored position: the last layer runs from there on only
    hidden = model(ids, pos, DenseCausalAttention(), suffix_from=s)
    rows = torch.cat([hidden[b, w.start - s:w.start - s + len(w.targets)] for b, w in enumerate(wins)])
    return rows, torch.cat([w.targets for w in wins]).to(device)


def _log_probs(model, h: torch.Tensor) -> torch.Tensor:
    return _normalized(model.compute_logits(h).float())


def _normalized(logits: torch.Tensor) -> torch.Tensor:
    return logits - torch.logsumexp(logits, dim=-1, keepdim=True)


class PagedScoring:
    """Windows scored through a ModelRunner (`llmopt/worker/runner.py`) whose KV cache holds
    `kv_cache_dtype`: one step a batch, each window a prompt in blocks of its own."""

    def __init__(self, loaded, kv_cache_dtype: str, windows: Sequence[Window], batch_size: int,
                 block_size: int = defaults.BLOCK_SIZE) -> None:
        from llmopt.worker.runner import ModelRunner   # deferred: start-up time (the engine's runner)
        longest = max(len(w.ids) for w in windows)
        self.kivi = None
        if kv_cache_dtype == "kivi2":
            self._kivi_runner(loaded, longest, max(1, batch_size))
            return
        self.block_size = block_size
        blocks = max(1, batch_size) * -(-longest // block_size)
        cfg = loaded.config
        per_block = cfg.num_hidden_layers * kernels.kv_block_bytes(block_size, cfg.num_key_value_heads,
                                                                   cfg.head_dim, kv_cache_dtype, torch.float32)
        self.runner = ModelRunner(loaded, block_size, kv_cache_dtype, kv_cache_memory=blocks * per_block,
                                  max_num_batched_tokens=max(1, batch_size) * longest)
        self.kv_dtype = self.runner.kv_dtype   # auto resolved

    def _kivi_runner(self, loaded, longest: int, batch: int) -> None:
        """A runner whose two pools hold `batch` windows of `longest` tokens, stepped a group at a time."""
        from llmopt.worker.runner import ModelRunner   # deferred: start-up time (the engine's runner)
        self.kivi = KiviConfig()
        g, cfg = self.kivi.group_size, loaded.config
        self.block_size = g
        q, r = request_blocks(longest, g, self.kivi.residual_length)
        d, heads, layers = cfg.head_dim, cfg.num_key_value_heads, cfg.num_hidden_layers
        page = layers * heads * page_bytes(g, d)
        residual = layers * kernels.kv_block_bytes(g, heads, d, "float32", torch.float32)
        memory = batch * (q * page + r * residual) + (batch + 1) * residual   # kivi_pools: a step's group each
        self.runner = ModelRunner(loaded, g, "kivi2", kv_cache_memory=memory, max_num_batched_tokens=batch * g,
                                  kivi=self.kivi, max_model_len=longest, max_num_seqs=batch)
        self.kv = KVCacheManager(self.runner.num_blocks, g, False, kivi=self.kivi,
                                 num_residual_blocks=self.runner.num_residual_blocks)
        self.kv_dtype = "kivi2"

    def _kivi_logits(self, wins: list[Window]) -> torch.Tensor:
        """The windows a group of tokens a step through the runner and the KV manager: the logits of
        each window's positions from its first scored one, window after window."""
        from types import SimpleNamespace
        g = self.block_size
        reqs = [SimpleNamespace(request_id=f"w{i}", all_token_ids=w.ids.tolist(), num_computed_tokens=0)
                for i, w in enumerate(wins)]
        rows: list[list[torch.Tensor]] = [[] for _ in wins]
        try:
            while any(r.num_computed_tokens < len(r.all_token_ids) for r in reqs):
                sched = []
                for i, (r, w) in enumerate(zip(reqs, wins)):
                    start = r.num_computed_tokens
                    n = min(g, len(r.all_token_ids) - start)
                    if n <= 0:
                        continue
                    if not self.kv.allocate_slots(r, n):
                        raise LLMOptError("the kivi2 scoring cache ran out of blocks")   # sized for the batch
                    s = ScheduledRequest(r.request_id, r.all_token_ids[start:start + n], start,
                                         self.kv.get_block_ids(r.request_id), max(0, min(n, start + n - w.start)))
                    s.num_quantized_blocks = self.kv.num_quantized_blocks(r.request_id)
                    sched.append((i, s))
                out = SchedulerOutput([s for _, s in sched])
                out.kivi_copies, out.kivi_converts = self.kv.take_kivi_work()
                logits = self.runner.execute(out)
                off = 0
                for i, s in sched:
                    rows[i].append(logits[off:off + s.num_logits])
                    off += s.num_logits
                    reqs[i].num_computed_tokens += len(s.token_ids)
        finally:
            for r in reqs:
                self.kv.free(r)
        return torch.cat([torch.cat(r)[:len(w.targets)] for r, w in zip(rows, wins)])

    def logits(self, wins: list[Window]) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 logits of the windows' scored positions [rows, vocab] and their targets."""
        if self.kivi is not None:
            return self._kivi_logits(wins), torch.cat([w.targets for w in wins])
        sched, first = [], 0
        for i, w in enumerate(wins):
            n = -(-len(w.ids) // self.block_size)
            sched.append(ScheduledRequest(f"w{i}", w.ids.tolist(), 0, list(range(first, first + n)),
                                          len(w.ids) - w.start))
            first += n
        logits = self.runner.execute(SchedulerOutput(sched))
        rows, off = [], 0
        for w in wins:   # each window's rows start at its first scored position
            rows.append(torch.arange(off, off + len(w.targets)))
            off += len(w.ids) - w.start
        return logits[torch.cat(rows)], torch.cat([w.targets for w in wins])


def _base_log_probs(base, base_paged: PagedScoring | None, wins: list[Window], device):
    """The base's log-probabilities of rows [a, b) of this batch, as base_lp(a, b); None: no base."""
    if base_paged is not None:
        logits = base_paged.logits(wins)[0]
        return lambda a, b: _normalized(logits[a:b])
    if base is not None:
        hb = _hidden_rows(base, wins, device)[0]
        return lambda a, b: _log_probs(base, hb[a:b])
    return None


def score_windows(model, windows: Sequence[Window], batch_size: int, device: torch.device,
                  base=None, progress: Callable[[int], None] | None = None,
                  chunk: int = defaults.LOSS_CHUNK_TOKENS, paged: PagedScoring | None = None,
                  base_paged: PagedScoring | None = None) -> Scores:
    """base_paged: the base scores through its own engine runner (with `paged`: the same path, so
    the KL divergence is the difference between the two runners' caches)."""
    s = Scores(window_nll=[0.0] * len(windows), window_count=[0] * len(windows))
    with torch.inference_mode():
        for idx in batches(windows, max(1, batch_size)):
            wins = [windows[i] for i in idx]
            if paged is not None:
                logits, tgt = paged.logits(wins)
                tgt = tgt.to(logits.device)
            else:
                h, tgt = _hidden_rows(model, wins, device)
            base_lp = _base_log_probs(base, base_paged, wins, device)
            nll = torch.empty(len(tgt), dtype=torch.float32, device=device)
            for a in range(0, len(tgt), chunk):
                t = tgt[a:a + chunk, None]
                if paged is not None:
                    lp = _normalized(logits[a:a + chunk])
                elif base_lp is None:
                    nll[a:a + chunk] = -score_tokens(model, h[a:a + chunk], t[:, 0], ranks=False, chunk=chunk).logprobs
                    continue
                else:
                    lp = _log_probs(model, h[a:a + chunk])
                if base_lp is None:
                    nll[a:a + chunk] = -lp.gather(-1, t)[:, 0]
                    continue
                lq = base_lp(a, a + chunk)
                nll[a:a + chunk] = -lp.gather(-1, t)[:, 0]
                s.base_nll += float(-lq.gather(-1, t)[:, 0].double().sum())
                s.kl.append((lq.exp() * (lq - lp)).sum(-1).cpu())
                s.agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
                del lp, lq
            off = 0
            for i, w in zip(idx, wins):
                n = len(w.targets)
                s.window_nll[i] = float(nll[off:off + n].double().sum())
                s.window_count[i] = n
                s.input_tokens += len(w.ids)
                off += n
            if progress:
                progress(len(wins))
    return s
