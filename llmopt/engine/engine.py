"""LLMEngine: requests in, one scheduled forward per `step()`, outputs back.

    engine = LLMEngine(EngineArgs(model=...))
    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

A prompt with n > 1 fans out into n child requests (ids `<id>#<i>`): the first computes the prompt,
the others fork from it sharing every prompt block (copy-on-write for the partial last one), and the
caller sees one RequestOutput with n completions. The step is: propose drafts (when a `Proposer`
is set, speculative/interface.py), schedule, run the forward (the `Executor`, worker/executor.py), sample,
`Scheduler.update_from_output` (which owns everything after sampling), build outputs.

A request is validated when it is added (`prepare_request`: token ids, top_k, logprobs and stop ids
against the vocabulary, the context length), so no request can make a step fail. Should one fail
anyway, the step runs each scheduled request alone: a request that fails alone (while the others, or
a one-token probe, run) is finished with finish_reason "error" and its blocks are freed; a failure no
request explains raises EngineDeadError.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from dataclasses import dataclass

from llmopt.cache.kivi import request_blocks as kivi_request_blocks
from llmopt.cache.kv_manager import KVCacheManager, cdiv, request_blocks
from llmopt.cache.offload import OffloadIndex
from llmopt.engine.args import EngineArgs
from llmopt.core.logits_processors import bad_words_token_ids
from llmopt.engine.detokenizer import IncrementalDetokenizer
from llmopt.engine.executor import create_executor
from llmopt.worker.executor import EngineDeadError, Executor
from llmopt.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmopt.speculative.interface import DraftProposal, Proposer, ProposeInput, ProposerContext, StepHiddenStates
from llmopt.core.request import Request
from llmopt.worker.runner import KVCacheInfo
from llmopt.core.sampler import Sampler, SampledTokens, SamplingRow
from llmopt.core.sampling_params import SamplingParams
from llmopt.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from llmopt.engine.spec_stats import SpecDecodingStats
from llmopt.errors import LLMOptError, UserInputError
from llmopt.models.loader import LoadedModel
from llmopt.structured.backend import StructuredOutputManager
from llmopt.validate import sample_seed

log = logging.getLogger("llmopt.engine")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int     # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int        # ... and found there
    num_preemptions: int
    spec_decoding: SpecDecodingStats | None = None   # speculative decoding: drafts and accepted tokens
    kv_offload_hit_tokens: int = 0     # prompt tokens found in the offload tier (counted in the hits above)
    kv_offload_saved_bytes: int = 0    # bytes copied from the pool into the tier
    kv_offload_loaded_bytes: int = 0   # bytes copied from the tier back into the pool

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class _Parent:
    """One prompt as added: its n samples (child requests), built and validated by prepare_request."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], children: list[Request]):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.children = children
        self.error: str | None = None


def eos_token_ids(loaded: LoadedModel) -> frozenset[int]:
    ids: set[int] = set()

    def add(x):
        if isinstance(x, int):
            ids.add(x)
        elif isinstance(x, (list, tuple)):
            ids.update(i for i in x if isinstance(i, int))

    add(loaded.config.eos_token_id)
    gen = loaded.path / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    if loaded.tokenizer is not None:
        add(loaded.tokenizer.eos_token_id)
    return frozenset(ids)


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, loaded: LoadedModel | None = None, progress=None,
                 **kwargs) -> None:
        args = args or EngineArgs(**kwargs)
        self.args = args
        # one process: a ModelRunner; tensor parallelism: rank 0 of the ranks that run each step (llmopt/distributed)
        self.executor: Executor = create_executor(args, loaded, progress, self._check_model)
        try:
            self._setup(args, self.executor.loaded)
        except BaseException:
            self.shutdown()
            raise

    @property
    def runner(self) -> Executor:
        """The executor (a ModelRunner in one process), under the name tests and scripts read it by."""
        return self.executor

    def _check_model(self, loaded: LoadedModel) -> None:
        self.max_model_len = self.args.max_model_len or loaded.config.max_position_embeddings
        if self.max_model_len > loaded.config.max_position_embeddings:   # refused, as vLLM refuses it
            raise UserInputError(f"--max-model-len {self.max_model_len:,} is longer than the model's context of "
                                 f"{loaded.config.max_position_embeddings:,} tokens (max_position_embeddings): "
                                 "give at most that")

    def _setup(self, args: EngineArgs, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = eos_token_ids(loaded)
        info = self.executor.kv_cache_info()
        # each KV-cache group frees the blocks its window has left (one group: every layer's window,
        # or none when mixed windows share one table); not when a proposer writes its own K/V over
        # the request's blocks: its attention may reach further
        windows = info.group_windows if args.speculative_config is None else [None] * len(info.group_windows)
        need = sum(request_blocks(self.max_model_len, args.block_size, w, args.max_num_batched_tokens) for w in windows)
        window = windows[0] if len(windows) == 1 else None
        if args.kivi is not None:   # the pools were sized for requests of max_model_len (llmopt/cache/kivi.py)
            need = kivi_request_blocks(self.max_model_len, args.kivi.group_size, args.kivi.residual_length)[0]
        if need > info.num_blocks:
            if len(windows) > 1:
                raise UserInputError(f"the KV cache holds {info.num_blocks:,} blocks of {args.block_size} tokens, fewer "
                                     f"than the {need:,} a request holds in its {len(windows)} KV-cache groups (windows "
                                     f"{', '.join(str(w or 'none') for w in windows)}) at --max-model-len "
                                     f"{self.max_model_len:,}: give it more memory or lower --max-model-len")
            if window:
                raise UserInputError(f"the KV cache holds {info.num_blocks:,} blocks of {args.block_size} tokens, fewer "
                                     f"than the {need:,} a request holds under its {window:,}-token window with "
                                     f"--max-num-batched-tokens {args.max_num_batched_tokens:,}: give it more memory or "
                                     "lower --max-num-batched-tokens")
            raise UserInputError(f"the KV cache holds {info.num_tokens:,} tokens, fewer than --max-model-len "
                                 f"{self.max_model_len:,}: give it more memory or lower --max-model-len")
        self.blocks_per_request = need
        offload = None
        if info.offload_slots:   # the second tier for evicted prefix blocks (llmopt/cache/offload.py)
            offload = OffloadIndex(info.offload_slots, info.offload_block_bytes, info.offload_restored)
            log.info("KV offload tier: %d blocks, %.1f MiB (%s), %d found from an earlier run", info.offload_slots,
                     info.offload_slots * info.offload_block_bytes / 2**20, args.kv_offload_dir or "host memory",
                     len(info.offload_restored))
        self.kv = KVCacheManager(info.num_blocks, args.block_size, args.enable_prefix_caching, offload=offload,
                                 group_windows=windows, kivi=args.kivi, num_residual_blocks=info.num_residual_blocks)
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len,
                                   args.scheduling_policy)
        # Speculative decoding: a proposer drafts tokens that the engine verifies in the same forward
        # (rejection sampling against the target's own distribution, core/sampler.py)
        self.proposer: Proposer | None = None
        self.spec_stats: SpecDecodingStats | None = None
        self._draft_probs: dict = {}    # this step's drafts' distributions (proposers that sample their drafts)
        if args.speculative_config is not None:
            # deferred: optional plug-in (draft models and EAGLE heads load only when speculation is asked for)
            from llmopt.speculative.proposer import build_proposer
            self.set_proposer(build_proposer(args.speculative_config, self.proposer_context()))
        self.sampler = Sampler(args.seed)
        self._structured: StructuredOutputManager | None = None   # built at the first structured request
        self._structured_lock = threading.Lock()
        self._parents: dict[str, _Parent] = {}
        self._counter = 0
        log.info("KV cache: %d blocks of %d tokens = %d tokens, %.1f MiB (%s)", info.num_blocks, info.block_size,
                 info.num_tokens, info.bytes_allocated / 2**20, info.kv_cache_dtype)
        if args.kivi is not None:
            log.info("kivi2: %d full-precision residual blocks, %.1f MiB", info.num_residual_blocks,
                     info.num_residual_blocks * info.residual_bytes_per_block * info.num_layers / 2**20)
        log.info("Maximum concurrency for %d tokens per request: %.2fx", self.max_model_len,
                 info.num_blocks / need if need else float(args.max_num_seqs))

    # -- speculative decoding ----------------------------------------------------------------------
    def proposer_context(self) -> ProposerContext:
        """What a proposer for this engine is built with."""
        return ProposerContext(self.loaded, self.args.dtype, self.executor.num_blocks, self.args.block_size,
                               self.executor.backend)

    def set_proposer(self, proposer: Proposer | None) -> None:
        """Draft with `proposer` from the next step on (None: no speculation); its counters start at 0.
        The engine does this at construction for `speculative_config`; any Proposer plugs in the same way.
        A proposer writing its own K/V over the requests' blocks keeps every block (no window freeing)."""
        if proposer is not None and proposer.writes_kv and self.kv.frees_blocks:
            if self.scheduler.has_unfinished():
                raise LLMOptError("a proposer that writes K/V needs every block of a request: set it before "
                                  "adding requests to a sliding-window model")
            need = len(self.kv.groups) * cdiv(self.max_model_len, self.kv.block_size)
            if need > self.kv.pool.num_blocks:
                raise UserInputError(f"{self.kv.pool.num_blocks:,} KV blocks cannot hold --max-model-len "
                                     f"{self.max_model_len:,} without freeing out-of-window blocks, which this proposer "
                                     "needs: give the cache more memory")
            self.kv.keep_all_blocks()
            self.blocks_per_request = need
        self.proposer = proposer
        self.scheduler.hidden_layers = None if proposer is None else proposer.hidden_layers
        self.spec_stats = None
        if proposer is not None:
            k = proposer.config.num_speculative_tokens
            self.spec_stats = SpecDecodingStats(proposer.method, k, num_accepted_tokens_per_pos=[0] * k)

    # -- requests ----------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise UserInputError("this engine has no tokenizer: pass token ids")
            return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
        return [int(t) for t in prompt]

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None) -> str:
        """Queue a prompt (text, or token ids); `prompt_token_ids` overrides tokenizing the text.
        Returns the request id (generated when None)."""
        parent = self.prepare_request(request_id, prompt, params, priority, arrival_time, prompt_token_ids)
        self.add_prepared(parent)
        return parent.request_id

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        """Refuse what would fail inside a step: token ids, top_k, logprobs and stop token ids
        outside the vocabulary, a prompt that leaves no room to generate."""
        vocab = self.loaded.config.vocab_size
        if not ids:
            raise UserInputError("the prompt is empty")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise UserInputError(f"prompt token id {bad} is outside the vocabulary: use ids in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise UserInputError(f"the prompt has {len(ids)} tokens; --max-model-len {self.max_model_len} leaves "
                                 f"no room to generate")
        if params.top_k > vocab:
            raise UserInputError(f"top_k {params.top_k} is larger than the vocabulary: use at most {vocab}")
        for name in ("logprobs", "prompt_logprobs"):
            if (k := getattr(params, name)) is not None and k > vocab:
                raise UserInputError(f"{name} {k} is larger than the vocabulary: use at most {vocab}")
        for what, ids in (("stop token id", params.stop_token_ids), ("logit_bias token id", params.logit_bias or ()),
                          ("allowed_token_ids id", params.allowed_token_ids or ())):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise UserInputError(f"{what} {bad} is outside the vocabulary: use ids in [0, {vocab})")

    def prepare_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                        priority: int = 0, arrival_time: float | None = None,
                        prompt_token_ids: list[int] | None = None) -> _Parent:
        """Tokenize, validate and build a prompt's requests without queueing them (it touches no
        scheduler state, so a server may call it while a step runs); `add_prepared` queues them."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{self._counter}"
        self._counter += 1
        if request_id in self._parents:
            raise UserInputError(f"request id {request_id!r} is already in use")
        try:
            ids = list(prompt_token_ids) if prompt_token_ids is not None else self.tokenize(prompt)
        except (TypeError, ValueError) as e:   # e.g. a lone surrogate the tokenizer cannot encode
            raise UserInputError(f"the prompt cannot be tokenized ({type(e).__name__}: {e}): send valid "
                                 "Unicode text or token ids") from None
        self.validate(ids, params)
        text = prompt if isinstance(prompt, str) else None
        grammar = self._grammar(params)
        bad_words = None
        if params.bad_words:
            if self.tokenizer is None:
                raise UserInputError("bad_words need the model's tokenizer")
            bad_words = bad_words_token_ids(self.tokenizer, params.bad_words)
        children = []
        for i in range(params.n):
            p = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else sample_seed(params.seed, i))
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            detok = IncrementalDetokenizer(self.tokenizer, ids, p.skip_special_tokens) \
                if self.args.detokenize and self.tokenizer is not None else None
            children.append(Request(rid, ids, p, self.eos_token_ids, self.max_model_len, text, priority,
                                    arrival_time, parent_id=request_id, index=i, detokenizer=detok,
                                    grammar=None if grammar is None else grammar.fork() if i else grammar,
                                    bad_words=bad_words))
        return _Parent(request_id, text, ids, children)

    def _grammar(self, params: SamplingParams):
        """A fresh structured-output matcher for the request (None without structured outputs). The
        manager and llguidance's view of the tokenizer are built at the first such request."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise UserInputError("structured outputs need the model's tokenizer")
        with self._structured_lock:
            if self._structured is None:
                self._structured = StructuredOutputManager(self.tokenizer, self.loaded.config.vocab_size,
                                                           sorted(self.eos_token_ids))
        return self._structured.grammar(params.structured_outputs)

    def add_prepared(self, parent: _Parent) -> None:
        """Queue a prompt built by prepare_request."""
        if parent.request_id in self._parents:
            raise UserInputError(f"request id {parent.request_id!r} is already in use")
        self.scheduler.add_request(parent.children[0], parent.children[1:])
        self._parents[parent.request_id] = parent

    def fail_request(self, request_id: str, message: str) -> _Parent | None:
        """Finish every unfinished sample of a prompt with finish_reason "error" (freeing their
        blocks); returns the prompt, whose next output carries `error`, or None if it is gone."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        log.error("request %s failed: %s", request_id, message)
        parent.error = parent.error or message
        for req in parent.children:
            if not req.is_finished:
                self.scheduler.fail_request(req, message)
        return parent

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            for req in parent.children:
                self.scheduler.abort_request(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_health(self) -> None:
        """Raise EngineDeadError when the engine can run no more steps (a tensor-parallel worker
        exited, even while idle); return quietly otherwise."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Release what outlives the engine object: tensor-parallel worker processes and the process
        group (also done at exit). A no-op on one rank."""
        self.executor.shutdown()

    def kv_cache_info(self) -> KVCacheInfo:
        return self.executor.kv_cache_info()

    def cache_config(self) -> dict[str, object]:
        """The KV cache's configuration under the names of vLLM's CacheConfig (the ones this engine
        has): its `cache_config_info` metric. num_gpu_blocks: the blocks allocated, on any device."""
        a = self.args
        return {"block_size": a.block_size, "cache_dtype": a.kv_cache_dtype,
                "enable_prefix_caching": a.enable_prefix_caching, "gpu_memory_utilization": a.gpu_memory_utilization,
                "kv_cache_memory_bytes": a.kv_cache_memory, "num_gpu_blocks": self.kv.pool.num_blocks}

    def stats(self) -> EngineStats:
        s = self.kv.stats
        out = EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.kv.pool.usage(),
                          s.queries, s.hits, self.scheduler.num_preemptions,
                          None if self.spec_stats is None else self.spec_stats.copy())
        if self.kv.offload is not None:
            o = self.kv.offload.stats
            out.kv_offload_hit_tokens, out.kv_offload_saved_bytes, out.kv_offload_loaded_bytes = \
                o.hit_tokens, o.saved_bytes, o.loaded_bytes
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as vLLM's reset_prefix_cache (after new weights, or to measure
        cold starts). Only while no request holds blocks; returns whether it did."""
        done = self.kv.pool.reset_prefix_cache()
        if done and self.kv.offload is not None:   # the tier's blocks are prefix-cache blocks too
            self.kv.offload.clear()
        return done

    # -- the step ------------------------------------------------------------------------------------
    def _propose_drafts(self) -> None:
        """Drafts for the decoding requests: K for the batch (capped per request by the scheduler,
        which allocates their lookahead slots), then the proposer's tokens to verify."""
        decoding = self.scheduler.decoding_requests()
        if not decoding:
            return
        p = self.proposer
        p.forget(self.scheduler.requests)
        ks = self.scheduler.schedule_lookahead(decoding, p.num_draft_tokens(len(self.scheduler.running)), p.writes_kv)
        drafting = [r for r in decoding if r.request_id in ks]
        proposal = p.propose(ProposeInput(drafting, ks, {r.request_id: self.kv.get_block_ids(r.request_id)
                                                         for r in drafting})) if drafting else DraftProposal()
        self.scheduler.set_drafts(decoding, proposal.token_ids)
        self._draft_probs = proposal.probs

    def _after_drafts(self, sched: SchedulerOutput, sampled: dict[str, SampledTokens], hidden) -> None:
        """Count the step's drafts and accepted tokens; give the proposer the hidden states it asked for."""
        self.spec_stats.record(sched, sampled)
        self._draft_probs = {}
        if self.proposer.hidden_layers is not None:
            rows = [(s.request_id, s.start_pos, len(s.token_ids)) for s in sched.scheduled]
            self.proposer.observe(None if hidden is None else StepHiddenStates(rows, hidden))

    def step(self) -> list[RequestOutput]:
        """Propose drafts (speculative decoding), schedule, run one forward, sample; outputs
        (cumulative) of the prompts that progressed."""
        if self.proposer is not None:
            self._propose_drafts()
        sched = self.scheduler.schedule()
        if sched.is_empty and (sched.kv_saves or sched.kv_loads):   # blocks evicted by a step that ran nothing
            self.executor.execute_model(sched)
        if sched.is_empty:
            if self.scheduler.has_unfinished() and not self.scheduler.running:  # even alone it does not fit
                head = self.scheduler.waiting.peek()
                failed = self.fail_request(head.parent_id, f"the KV cache ({self.kv.pool.num_blocks} blocks) cannot "
                                           f"place this request's {head.num_tokens} tokens")
                return [self._output(failed)] if failed is not None else []
            return []
        failed: list[_Parent] = []
        hidden = None
        try:
            out = self.executor.execute_model(sched)
            hidden, scored = out.hidden_states, out.prompt_logprobs
            sampled = self._sample(out.logits, sched.scheduled)
        except EngineDeadError:    # no request's fault (a tensor-parallel worker exited)
            raise
        except Exception as e:  # noqa: BLE001 - find whose failure it is
            hidden = None
            sampled, scored, failed = self._isolate(sched, e)
        if self.proposer is not None:
            self._after_drafts(sched, sampled, hidden)
        progressed = self.scheduler.update_from_output(sched, sampled, scored)
        for req in progressed:   # a sample that failed after sampling fails its whole prompt
            if req.error is not None and (p := self.fail_request(req.parent_id, req.error)) is not None:
                failed.append(p)
        touched = {p.request_id: p for p in failed}
        touched.update({req.parent_id: self._parents[req.parent_id] for req in progressed
                        if req.parent_id in self._parents})
        return [self._output(p) for p in touched.values()]

    def _sample(self, logits, scheduled: list[ScheduledRequest]) -> dict[str, SampledTokens]:
        # the drafts' distributions only when a proposer sampled its drafts (greedy drafts: a one-hot q)
        extra = (self._draft_probs,) if self._draft_probs else ()
        return self.sampler.sample_scheduled(logits, scheduled, self.scheduler.requests, *extra)

    def _isolate(self, sched: SchedulerOutput, error: Exception) -> tuple[dict[str, SampledTokens], dict,
                                                                          list[_Parent]]:
        """The batched forward or sampling raised: run each scheduled request alone. A request
        that fails alone is finished with an error (its blocks freed) when the others run, or a
        one-token probe does; when nothing runs, the engine is broken: EngineDeadError."""
        log.warning("a step of %d requests failed (%s: %s); running them one by one", len(sched.scheduled),
                    type(error).__name__, error)
        try:
            self.executor.copy_blocks(sched.blocks_to_copy)   # idempotent: the failed step may have done it
        except Exception as e:  # noqa: BLE001
            raise EngineDeadError(f"the engine failed: {type(e).__name__}: {e}") from e
        sampled: dict[str, SampledTokens] = {}
        scored: dict = {}
        bad: dict[str, Exception] = {}
        for s in sched.scheduled:
            try:
                out = self.executor.execute_model(SchedulerOutput([s]))
                sampled.update(self._sample(out.logits, [s]))
                scored.update(out.prompt_logprobs)
            except Exception as e:  # noqa: BLE001
                bad[s.request_id] = e
        parents = []
        for rid, e in bad.items():
            req = self.scheduler.requests.get(rid)
            if req is not None and (p := self.fail_request(req.parent_id, f"{type(e).__name__}: {e}")) is not None:
                parents.append(p)
        if len(bad) == len(sched.scheduled) and not self._probe():
            raise EngineDeadError(f"the engine failed: {type(error).__name__}: {error}") from error
        return sampled, scored, parents

    def _probe(self) -> bool:
        """Whether a forward and a draw still work: one token alone in a free block."""
        pool = self.kv.pool if self.kv.kivi is None else self.kv.kivi.pool   # kivi2 writes the residual
        if pool.num_free_blocks < 1:
            return False
        (block,) = pool.get_new_blocks(1)
        try:
            probe = ScheduledRequest("probe", [0], 0, [block.block_id], 1)
            if len(self.kv.groups) > 1:   # every group's table: the one block (it writes it in each)
                probe.group_block_ids = [[block.block_id]] * len(self.kv.groups)
            out = SchedulerOutput([probe])
            out.kv_saves, out.kv_loads = self.kv.take_transfers()   # a block it evicted is saved first
            logits = self.executor.execute_model(out).logits
            self.sampler(logits, [SamplingRow(SamplingParams(temperature=0), [0], [])])
            return True
        except Exception as e:  # noqa: BLE001
            log.error("the engine's probe failed too: %s: %s", type(e).__name__, e)
            return False
        finally:
            pool.free_blocks([block])

    def _output(self, parent: _Parent) -> RequestOutput:
        outs = [CompletionOutput(req.index, req.text, list(req.output_token_ids),
                                 req.cumulative_logprob if req.logprobs is not None else None,
                                 list(req.logprobs) if req.logprobs is not None else None, req.finish_reason,
                                 req.stop_reason, req.metrics if req.is_finished else None)
                for req in parent.children]
        finished = all(r.is_finished for r in parent.children)
        if finished:
            del self._parents[parent.request_id]
        cached = max(parent.children[0].num_cached_tokens, 0)
        metrics = RequestMetrics.merge([r.metrics for r in parent.children])
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outs, finished, cached,
                             metrics, parent.error, _prompt_logprobs(parent.children[0]))


def _prompt_logprobs(req) -> list | None:
    """The prompt's logprobs once every position is scored (None while a chunk is still to come)."""
    got = req.prompt_logprobs
    return list(got) if got is not None and len(got) == req.num_prompt_tokens else None
