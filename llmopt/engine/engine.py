"""LLMEngine: requests in, one scheduled forward per `step()`, outputs back.

    engine = LLMEngine(EngineArgs(model=...))
    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

A prompt with n > 1 fans out into n child requests (ids `<id>#<i>`); with prefix caching the
children share the prompt's full blocks, and the caller sees one RequestOutput with n completions.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from llmopt import kernels
from llmopt.cache.kv_manager import KVCacheManager, cdiv
from llmopt.engine.args import EngineArgs
from llmopt.engine.detokenizer import IncrementalDetokenizer
from llmopt.engine.outputs import CompletionOutput, RequestOutput
from llmopt.engine.request import Request, RequestStatus, TokenLogprobs
from llmopt.engine.runner import KVCacheInfo, ModelRunner
from llmopt.engine.sampler import Sampler, SamplingRow
from llmopt.engine.sampling_params import SamplingParams
from llmopt.engine.scheduler import Scheduler
from llmopt.errors import LLMOptError, UserInputError
from llmopt.models.loader import LoadedModel, load_model

log = logging.getLogger("llmopt.engine")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


class _Parent:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], children: list[Request]):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.children = children


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
        kernels.set_backend(args.attention_backend)
        if loaded is None:
            loaded = load_model(args.model, args.dtype, args.device, progress)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = eos_token_ids(loaded)
        self.max_model_len = args.max_model_len or loaded.config.max_position_embeddings
        self.runner = ModelRunner(loaded, args.block_size, args.kv_cache_dtype, args.kv_cache_memory,
                                  args.gpu_memory_utilization, args.max_num_batched_tokens)
        info = self.runner.kv_cache_info()
        need = cdiv(self.max_model_len, args.block_size)
        if need > info.num_blocks:
            raise UserInputError(f"the KV cache holds {info.num_tokens:,} tokens, fewer than --max-model-len "
                                 f"{self.max_model_len:,}: give it more memory or lower --max-model-len")
        self.kv = KVCacheManager(info.num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len,
                                   args.scheduling_policy)
        self.sampler = Sampler(args.seed)
        self._parents: dict[str, _Parent] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._counter = 0
        # Speculative decoding hook: drafter(requests) -> {request_id: draft token ids}; the engine
        # verifies all drafts of a request in the same forward (exact-match against the target's
        # own samples, which keeps the target's distribution).
        self.drafter: Callable[[list[Request]], dict[str, list[int]]] | None = None
        log.info("KV cache: %d blocks of %d tokens = %d tokens, %.1f MiB (%s)", info.num_blocks, info.block_size,
                 info.num_tokens, info.bytes_allocated / 2**20, info.kv_cache_dtype)
        log.info("Maximum concurrency for %d tokens per request: %.2fx", self.max_model_len,
                 info.num_tokens / self.max_model_len)

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
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{self._counter}"
        self._counter += 1
        if request_id in self._parents:
            raise UserInputError(f"request id {request_id!r} is already in use")
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.tokenize(prompt)
        if not ids:
            raise UserInputError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise UserInputError(f"the prompt has {len(ids)} tokens; --max-model-len {self.max_model_len} leaves "
                                 f"no room to generate")
        text = prompt if isinstance(prompt, str) else None
        children = []
        for i in range(params.n):
            p = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(rid, ids, p, self.eos_token_ids, self.max_model_len, text, priority,
                                    arrival_time, parent_id=request_id, index=i))
            if params.n > 1 and not self.args.enable_prefix_caching:  # share the prompt among siblings only
                children[-1].cache_salt = f"n:{request_id}"
        self._parents[request_id] = _Parent(request_id, text, ids, children)
        for req in children:
            if self.args.detokenize and self.tokenizer is not None:
                rp = req.params
                self._detok[req.request_id] = IncrementalDetokenizer(
                    self.tokenizer, ids, rp.skip_special_tokens, rp.stop, rp.include_stop_str_in_output)
            self.scheduler.add_request(req)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            for req in parent.children:
                self.scheduler.abort_request(req.request_id)
                self._detok.pop(req.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def kv_cache_info(self) -> KVCacheInfo:
        return self.runner.kv_cache_info()

    def stats(self) -> EngineStats:
        s = self.kv.stats
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.kv.pool.usage(),
                           s.queries, s.hits, self.scheduler.num_preemptions)

    # -- the step ------------------------------------------------------------------------------------
    def _propose_drafts(self) -> None:
        """Ask the drafter for tokens to verify after each decoding request's last token."""
        decoding = [r for r in self.scheduler.running if r.num_computed_tokens == r.num_tokens - 1]
        if not decoding:
            return
        proposals = self.drafter(decoding) or {}
        for req in decoding:
            room = min(self.max_model_len - req.num_tokens, req.max_tokens - req.num_output_tokens) - 1
            req.spec_token_ids = list(proposals.get(req.request_id, ()))[:max(room, 0)]

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; outputs (cumulative) of the prompts that progressed."""
        if self.drafter is not None:
            self._propose_drafts()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.has_unfinished() and not self.scheduler.running:
                raise LLMOptError("the scheduler cannot place the next waiting request in the KV cache")
            return []
        logits = self.runner.execute(sched)
        self.scheduler.update_after_step(sched)
        # One group of rows per request that samples: its last position, or the positions of the
        # last token and of k draft tokens being verified (then drafts[j] is checked against row j).
        groups: list[tuple[Request, int, int, list[int]]] = []
        rows: list[int] = []
        sampling: list[SamplingRow] = []
        off = 0
        for s in sched.scheduled:
            m = s.num_logits
            if m:
                req = self.scheduler.requests[s.request_id]
                groups.append((req, len(rows), m, s.token_ids[len(s.token_ids) - m + 1:]))
                rows.extend(range(off, off + m))
                sampling.extend([SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids, req.generator,
                                             req.blocked_token_ids)] * m)
            off += m
        if not groups:
            return []
        picked = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows)]
        result = self.sampler(picked, sampling)
        touched: dict[str, _Parent] = {}
        for req, first, m, drafts in groups:
            for j in range(m):
                tok = result.token_ids[first + j]
                finished = self._append(req, tok, result, first + j)
                if finished or j == m - 1 or tok != drafts[j]:
                    break  # a rejected draft: the target's own token replaces it
            if not req.is_finished:
                req.num_computed_tokens = req.num_tokens - 1  # K/V valid for all but the newest token
                req.spec_token_ids = []
            parent = self._parents.get(req.parent_id)
            if parent is not None:
                touched[parent.request_id] = parent
        return [self._output(p) for p in touched.values()]

    def _append(self, req: Request, tok: int, result, row: int) -> bool:
        """Add one sampled token to a request; finish it on a stop condition. Returns finished."""
        req.append_output_token(tok)
        if req.logprobs is not None:
            top = dict(zip(result.top_ids[row], result.top_logprobs[row])) if result.top_ids else {}
            req.logprobs.append(TokenLogprobs(tok, result.logprobs[row], top))
            req.cumulative_logprob += result.logprobs[row]
        status = req.check_stop_token(tok)
        detok = self._detok.get(req.request_id)
        if detok is not None:
            stop = detok.add([tok])
            if stop is not None and status is None and req.num_output_tokens >= req.params.min_tokens:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        if status is not None:
            self.scheduler.finish_request(req, status)
            return True
        return False

    def _output(self, parent: _Parent) -> RequestOutput:
        outs = []
        for req in parent.children:
            detok = self._detok.get(req.request_id)
            outs.append(CompletionOutput(
                req.index, detok.text if detok else "", list(req.output_token_ids),
                req.cumulative_logprob if req.logprobs is not None else None,
                list(req.logprobs) if req.logprobs is not None else None, req.finish_reason, req.stop_reason))
        finished = all(r.is_finished for r in parent.children)
        if finished:
            del self._parents[parent.request_id]
            for req in parent.children:
                self._detok.pop(req.request_id, None)
        cached = max(parent.children[0].num_cached_tokens, 0)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outs, finished, cached)
