"""Continuous batching with chunked prefill, as in vLLM v1: there are no prefill or decode phases,
only requests whose computed-token count catches up with their token count.

`schedule()` spends a token budget (`max_num_batched_tokens`): first on running requests (decodes,
the next chunk of a long prompt, draft tokens to verify), then on waiting requests in policy order
(FCFS, or priority: lower value first, then arrival), while fewer than `max_num_seqs` run. When the
KV cache runs out of blocks, the lowest-priority running request is preempted: its blocks are freed
and it goes back to the front of the queue, to be recomputed later (from prefix-cache hits if its
blocks survive).

Drafts (speculative decoding): before `schedule()`, `schedule_lookahead` says how many drafts each
decoding request may verify and allocates the lookahead slots a proposer writing draft K/V needs;
`set_drafts` takes the proposer's tokens, which `schedule()` then schedules after the request's last
token. The scheduler is the only owner of a request's blocks.

`update_from_output()` is the one owner of what happens after sampling: it advances computed-token
counts, accepts sampled tokens (drafts up to the first mismatch, then the target's own token),
rewinds rejected drafts, runs `check_stop` after every token and finishes requests.

The n samples of one prompt: only the first is queued; its siblings wait until the prompt is
computed, then fork from it (sharing every prompt block, copy-on-write for the partial last one)
and take their first token from the same logits row.

Prompt logprobs (`SamplingParams.prompt_logprobs`): such a request reads from the prefix cache only
the positions before the first one it scores (`prompt_logprobs_start`: a scored position must be
computed), and each chunk asks the runner to score the
prompt positions it computes that are not scored yet (`prompt_targets`, so a recompute after a
preemption scores nothing twice); `update_from_output` appends what the runner returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from llmopt.cache.kv_manager import KVCacheManager
from llmopt.core.outputs import TokenLogprobs
from llmopt.models.logprobs import ScoredTokens
from llmopt.core.request import Request, RequestStatus
from llmopt.core.sampler import SampledTokens
from llmopt.core.stop import check_stop
from llmopt.core.waiting_queue import POLICIES, WaitingQueue  # noqa: F401  (POLICIES re-exported)
from llmopt.errors import UserInputError


@dataclass
class ScheduledRequest:
    """What the runner needs to compute one request's tokens this step (self-contained, so it could
    be sent to another process or rank)."""
    request_id: str
    token_ids: list[int]     # the tokens to compute: a prompt chunk, the last sampled token, drafts
    start_pos: int           # position of token_ids[0] (= tokens already in the cache)
    block_ids: list[int]     # the request's whole block table
    num_logits: int          # trailing positions whose logits are wanted (0: a prompt chunk)
    spec_token_ids: list[int] = field(default_factory=list)  # the drafts at the end of token_ids
    fork_ids: list[str] = field(default_factory=list)        # siblings sampled from this prompt's last row
    # prompt logprobs: row token_ids[prompt_offset + j] is scored on prompt_targets[j] (with the top k)
    prompt_targets: list[int] = field(default_factory=list)
    prompt_offset: int = 0
    prompt_top_k: int = 0
    group_block_ids: list[list[int]] | None = None   # every KV-cache group's table (hybrid models)
    num_quantized_blocks: int = 0    # KIVI: block_ids' leading main-pool (2-bit) blocks; residual ones after


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward
    # the offload tier's transfers, before the copies: (block, slot) saves, then (slot, block) loads
    kv_saves: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, int]] = field(default_factory=list)
    # KIVI, after the copies: residual block copies (src, dst), then conversions (residual, main block)
    kivi_copies: list[tuple[int, int]] = field(default_factory=list)
    kivi_converts: list[tuple[int, int]] = field(default_factory=list)
    # the target's hidden states the runner returns with the logits: None = none; () = the final ones;
    # layer indices = also the hidden state entering each (set by the engine from its proposer)
    hidden_layers: tuple[int, ...] | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs", hidden_layers: tuple[int, ...] | None = None) -> None:
        self.kv = kv
        self.hidden_layers = hidden_layers   # what every step's output asks the runner for (the engine's proposer)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.forks: dict[str, list[Request]] = {}   # first sample's id -> siblings waiting for its prompt
        self.num_preemptions = 0

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, req: Request, siblings: list[Request] = ()) -> None:
        """Queue a request; `siblings` (same prompt) fork from it once its prompt is computed."""
        for r in (req, *siblings):
            if r.request_id in self.requests:
                raise UserInputError(f"request id {r.request_id!r} is already in use")
        for r in (req, *siblings):
            self.requests[r.request_id] = r
        if siblings:
            self.forks[req.request_id] = list(siblings)
        self.waiting.add(req)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def num_unfinished(self) -> int:
        return len(self.requests)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Finish (stop, length) or abort a request: release its blocks and forget it."""
        if req.request_id not in self.requests:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:  # a sibling still waiting for its fork
            for sibs in self.forks.values():
                if req in sibs:
                    sibs.remove(req)
        siblings = self.forks.pop(req.request_id, [])
        if siblings:  # the next sample takes over the prompt
            self.forks[siblings[0].request_id] = siblings[1:]
            self.waiting.add_front(siblings[0])
        req.status = status
        req.metrics.finished_time = time.monotonic()
        self.kv.free(req)
        self.kv.forget(req)
        del self.requests[req.request_id]

    def abort_request(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return req

    # -- scheduling ----------------------------------------------------------------------------
    def _victim(self) -> Request:
        if self.waiting.priority:
            return max(self.running)
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(req)

    # -- drafts (speculative decoding) ---------------------------------------------------------------
    def draft_room(self, req: Request) -> int:
        """Drafts a decoding request can verify: the tokens it may still produce (max_tokens, the
        model length), less the one the target always samples."""
        return min(self.max_model_len - req.num_tokens, req.max_tokens - req.num_output_tokens) - 1

    def decoding_requests(self) -> list[Request]:
        """Running requests whose next step computes their last sampled token: the ones that draft."""
        return [r for r in self.running if r.num_computed_tokens == r.num_tokens - 1]

    def schedule_lookahead(self, reqs: list[Request], k: int, writes_kv: bool) -> dict[str, int]:
        """How many drafts each decoding request may verify this step: `k`, capped by its room. When
        the drafts' own K/V is written over the request's block table (`writes_kv`), the lookahead
        slots come first (`allocate_slots(num_lookahead_tokens=)`); a request whose slots do not fit
        drafts nothing (nothing is preempted for a draft). The blocks stay the request's: freed with
        it, and the ones drafts did not fill are written by its next tokens."""
        ks: dict[str, int] = {}
        for r in reqs:
            kr = min(k, self.draft_room(r))
            if kr > 0 and (not writes_kv or self.kv.allocate_slots(r, 1, num_lookahead_tokens=kr)):
                ks[r.request_id] = kr
        return ks

    def set_drafts(self, reqs: list[Request], drafts: dict[str, list[int]]) -> None:
        """The tokens `schedule()` puts after each request's last one for verification (capped by its room)."""
        for req in reqs:
            req.spec_token_ids = list(drafts.get(req.request_id, ()))[:max(self.draft_room(req), 0)]

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chosen: dict[str, tuple[Request, int]] = {}
        preempted: list[str] = []

        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens_with_spec - req.num_computed_tokens, budget,
                    self.max_model_len - req.num_computed_tokens)
            if n <= 0:
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self._victim()
                if victim.request_id in chosen:  # scheduled earlier in this step: give its budget back
                    budget += chosen.pop(victim.request_id)[1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status == RequestStatus.RUNNING:
                chosen[req.request_id] = (req, n)
                budget -= n

        while not preempted and budget > 0 and len(self.waiting) and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            group = 1 + len(self.forks.get(req.request_id, ()))
            if self.running and len(self.running) + group > self.max_num_seqs:
                break
            unscored = req.prompt_logprobs is not None and len(req.prompt_logprobs) < req.num_prompt_tokens
            # positions still to score must be computed: hits may cover only the ones before them
            hits, n_hit = self.kv.get_computed_blocks(req, len(req.prompt_logprobs) - 1 if unscored else None)
            n = min(req.num_tokens - n_hit, budget)
            if not self.kv.allocate_slots(req, n, hits):
                break
            self.waiting.pop()
            self.kv.record_lookup(req.num_tokens, n_hit)
            req.num_computed_tokens = n_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = n_hit
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chosen[req.request_id] = (req, n)
            budget -= n

        out = SchedulerOutput(preempted=preempted, blocks_to_copy=self.kv.take_copies(), hidden_layers=self.hidden_layers)
        out.kv_saves, out.kv_loads = self.kv.take_transfers()
        out.kivi_copies, out.kivi_converts = self.kv.take_kivi_work()
        for req, n in chosen.values():
            start = req.num_computed_tokens
            tokens = req.all_token_ids[start:start + n] if start + n <= req.num_tokens else \
                (req.all_token_ids + req.spec_token_ids)[start:start + n]
            num_logits = max(0, start + n - req.num_tokens + 1)
            forks = self.forks.get(req.request_id, []) if num_logits else []
            s = ScheduledRequest(req.request_id, tokens, start, self.kv.get_block_ids(req.request_id), num_logits,
                                 tokens[len(tokens) - num_logits + 1:], [r.request_id for r in forks])
            if len(self.kv.groups) > 1:
                s.group_block_ids = self.kv.get_group_block_ids(req.request_id)
            if self.kv.kivi is not None:
                s.num_quantized_blocks = self.kv.num_quantized_blocks(req.request_id)
            if req.prompt_logprobs is not None:
                self._ask_prompt_logprobs(req, s)
            out.scheduled.append(s)
            out.num_batched_tokens += n
        return out

    @staticmethod
    def _ask_prompt_logprobs(req: Request, s: ScheduledRequest) -> None:
        """Score the chunk's positions p whose next token p + 1 is a prompt token not scored yet."""
        first = max(s.start_pos, len(req.prompt_logprobs) - 1)
        end = min(s.start_pos + len(s.token_ids), req.num_prompt_tokens - 1)
        if end > first:
            s.prompt_targets = req.prompt_token_ids[first + 1:end + 1]
            s.prompt_offset = first - s.start_pos
            s.prompt_top_k = req.params.prompt_logprobs

    # -- after the forward ---------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, SampledTokens],
                           prompt_logprobs: dict[str, ScoredTokens] | None = None) -> list[Request]:
        """Apply one step's results: computed-token counts, prompt logprobs, forks, accepted tokens,
        rewinds of rejected drafts, stop checks. Returns the requests that received tokens (finished
        ones included)."""
        now = time.monotonic()
        progressed: list[Request] = []
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None:
                continue
            req.num_computed_tokens = s.start_pos + len(s.token_ids)
            if prompt_logprobs and s.request_id in prompt_logprobs and req.prompt_logprobs is not None:
                req.prompt_logprobs.extend(_token_logprobs(s.prompt_targets, prompt_logprobs[s.request_id]))
            if s.request_id not in sampled:  # a prompt chunk: nothing to sample yet
                continue
            siblings = [r for r in self.forks.pop(req.request_id, []) if r.request_id in sampled]
            for sib in siblings:
                self._fork(req, sib, req.num_computed_tokens - len(s.spec_token_ids))
            for r, drafts in [(req, s.spec_token_ids)] + [(sib, []) for sib in siblings]:
                try:
                    self._accept(r, drafts, sampled[r.request_id], now)
                except Exception as e:  # noqa: BLE001 - this request's own failure (detokenizing, a stop check)
                    self.fail_request(r, f"{type(e).__name__}: {e}")
                progressed.append(r)
        return progressed

    def fail_request(self, req: Request, message: str) -> None:
        """Finish a request with finish_reason "error" (its blocks freed); `message` says why."""
        req.error = message
        self.finish_request(req, RequestStatus.FINISHED_ERROR)

    def _fork(self, leader: Request, sib: Request, num_tokens: int) -> None:
        """A sibling takes the leader's computed prompt: its blocks (shared) and computed count. With
        no room to copy a KIVI residual, it waits at the front of the queue instead, as if preempted
        (it finds the prompt's quantized blocks in the prefix cache)."""
        sib.num_cached_tokens = leader.num_cached_tokens
        if sib.prompt_logprobs is not None:   # scored once (a recompute may take the prompt's pages)
            sib.prompt_logprobs = list(leader.prompt_logprobs or [None])
        sib.metrics.first_scheduled_time = leader.metrics.first_scheduled_time
        if not self.kv.fork(leader, sib, num_tokens):
            sib.num_computed_tokens = 0
            sib.status = RequestStatus.PREEMPTED
            self.waiting.add_front(sib)
            self.num_preemptions += 1
            return
        sib.num_computed_tokens = num_tokens
        sib.status = RequestStatus.RUNNING
        self.running.append(sib)

    def _accept(self, req: Request, drafts: list[int], got: SampledTokens, now: float) -> None:
        """Row j of `got` is the target's token after the first j drafts: keep drafts while they
        match it, then the target's own token (a correction, or a bonus after all k drafts)."""
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        accepted = 0
        for j, tok in enumerate(got.token_ids):
            new_text = req.append_output_token(tok, got.logprob(j), got.top(j))
            req.metrics.token_times.append(now)
            status = check_stop(req, new_text)
            if status is not None:
                self.finish_request(req, status)
                return
            if j >= len(drafts) or tok != drafts[j]:
                break
            accepted += 1
        req.num_computed_tokens -= len(drafts) - accepted  # the rejected drafts' K/V are stale
        req.spec_token_ids = []


def _token_logprobs(targets: list[int], scored: ScoredTokens) -> list[TokenLogprobs]:
    lp, ranks, ids, top = (scored.logprobs.tolist(), scored.ranks.tolist(), scored.top_ids.tolist(),
                           scored.top_logprobs.tolist())
    return [TokenLogprobs(t, lp[j], dict(zip(ids[j], top[j])), ranks[j]) for j, t in enumerate(targets)]
