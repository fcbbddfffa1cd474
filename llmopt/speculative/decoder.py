"""SpecDecoder: the engine's drafter (`LLMEngine.drafter`) for a SpeculativeConfig, and its counters.

Called at the start of each step with the requests that decode: it picks K for the running batch
(0 above disable_by_batch_size or where the per-batch-size map says 0), caps it by each request's
room (max_tokens, the model length), allocates the slots the draft's own KV needs (K more after
the last token; a request whose slots do not fit drafts nothing) and asks the method's proposer.
After the step (`record`), it counts drafts and accepted tokens per position, as vLLM's
spec_decode_* metrics, and hands the target's hidden states to EAGLE heads."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmopt.speculative.config import SpeculativeConfig


@dataclass
class SpecDecodingStats:
    """Counters since the engine started (vLLM's spec_decode_num_drafts, _num_draft_tokens,
    _num_accepted_tokens, _num_accepted_tokens_per_pos)."""
    method: str
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens each verifying step yields per request."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def acceptance_rate_per_pos(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.num_accepted_tokens_per_pos]

    def copy(self) -> "SpecDecodingStats":
        return SpecDecodingStats(self.method, self.num_speculative_tokens, self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos))


class SpecDecoder:
    def __init__(self, engine, config: SpeculativeConfig) -> None:
        self.engine = engine
        self.config = config
        self.counters = SpecDecodingStats(config.method, config.num_speculative_tokens,
                                          num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self.proposer = build_proposer(engine, config)

    @property
    def stats(self) -> SpecDecodingStats:
        return self.counters.copy()

    def __call__(self, reqs) -> dict[str, list[int]]:
        eng = self.engine
        if hasattr(self.proposer, "forget"):
            self.proposer.forget(eng.scheduler.requests)
        k = self.config.num_tokens_for_batch(len(eng.scheduler.running))
        if k <= 0:
            return {}
        ks: dict[str, int] = {}
        for r in reqs:
            room = min(eng.max_model_len - r.num_tokens, r.max_tokens - r.num_output_tokens) - 1
            kr = min(k, room)
            if kr > 0 and (not self.proposer.needs_slots or eng.kv.allocate_slots(r, 1 + kr)):
                ks[r.request_id] = kr
        reqs = [r for r in reqs if r.request_id in ks]
        if not reqs:
            return {}
        return self.proposer.propose(reqs, ks, eng.kv.get_block_ids)

    def record(self, sched, sampled) -> None:
        """Count this step's drafts and how many of each were accepted (leading drafts equal to the
        token their row chose); give hidden states to proposers that read them."""
        c = self.counters
        for s in sched.scheduled:
            drafts = s.spec_token_ids
            got = sampled.get(s.request_id)
            if not drafts or got is None:
                continue
            a = 0
            while a < len(drafts) and a < len(got.token_ids) and got.token_ids[a] == drafts[a]:
                a += 1
            c.num_drafts += 1
            c.num_draft_tokens += len(drafts)
            c.num_accepted_tokens += a
            for j in range(a):
                c.num_accepted_tokens_per_pos[j] += 1
        if hasattr(self.proposer, "observe"):
            self.proposer.observe(sched)


class NgramProposer:
    needs_slots = False

    def __init__(self, config: SpeculativeConfig) -> None:
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, reqs, ks, block_ids) -> dict[str, list[int]]:
        from llmopt.speculative.ngram import ngram_propose
        out = {}
        for r in reqs:
            d = ngram_propose(r.all_token_ids, ks[r.request_id], self.n_min, self.n_max)
            if d:
                out[r.request_id] = d
        return out


def build_proposer(engine, config: SpeculativeConfig):
    if config.method == "ngram":
        return NgramProposer(config)
    args, runner = engine.args, engine.runner
    if config.method == "draft_model":
        from llmopt.models.loader import load_model
        from llmopt.speculative.draft_model import DraftModelProposer
        draft = load_model(config.model, args.dtype, str(engine.loaded.device), tokenizer=False)
        return DraftModelProposer(draft, engine.loaded.config, runner.num_blocks, args.block_size, runner.backend)
    from llmopt.speculative.eagle import EagleProposer
    return EagleProposer(engine, config)
