"""The offline benchmark: the engine in-process, on the same workload and schedule as the online one.

One loop adds the requests that are due (and fit under --max-concurrency) between engine steps and
steps the engine. Times come from the engine's own per-request timestamps (RequestMetrics:
arrival = when the request was added, its per-token sample times, finish): TTFT = first token −
arrival, ITL = gaps between the steps that gave the request tokens, E2EL = finish − arrival. So an
online run against `llmopt serve` with the same engine flags differs by the HTTP and streaming
overhead only.

`compare_hf` runs transformers' `generate` (greedy, batches of --max-concurrency prompts, left
padded) on the same prompts and lengths, for a throughput ratio.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from llmopt.bench.config import BenchConfig, Hooks, RunOutput
from llmopt.bench.datasets import SampleRequest
from llmopt.bench.metrics import RequestRecord, ServerStats
from llmopt.bench.schedule import Load, arrivals
from llmopt.core.sampling_params import SamplingParams
from llmopt.engine.engine import LLMEngine

_IDLE = 0.005   # seconds to sleep while nothing runs and the next request is not due


def chat_text(tokenizer, prompt: str) -> str:
    """The prompt as the server's chat endpoint builds it (a user message in the chat template)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def prompt_ids(engine, cfg: BenchConfig, req: SampleRequest) -> list[int]:
    """The token ids the server would run for this request (completions: tokenized with special
    tokens; chat: the template's text without adding them again)."""
    if cfg.chat:
        return engine.tokenize(chat_text(engine.tokenizer, req.prompt), add_special_tokens=False)
    return engine.tokenize(req.prompt)


def sampling_params(cfg: BenchConfig, req: SampleRequest):
    s = cfg.sampling
    return SamplingParams(max_tokens=req.expected_output_len, temperature=s.temperature,
                          top_p=1.0 if s.top_p is None else s.top_p, top_k=s.top_k or 0,
                          min_p=s.min_p or 0.0, ignore_eos=s.ignore_eos)


def _record(rec: RequestRecord, out, t0: float) -> None:
    """Fill a record from a finished RequestOutput (engine timestamps, time.monotonic())."""
    m = out.metrics
    c = out.outputs[0]
    rec.output_tokens = len(c.token_ids)
    rec.generated_text = c.text
    if c.finish_reason == "abort":
        rec.cancelled = True
        return
    if c.finish_reason == "error":       # the engine failed this request alone
        rec.error = f"engine error: {getattr(out, 'error', None) or 'unknown'}"
        return
    times = sorted(set(m.token_times))
    rec.start_time = m.arrival_time - t0
    rec.latency = (m.finished_time if m.finished_time is not None else time.monotonic()) - m.arrival_time
    rec.ttft = (m.first_token_time - m.arrival_time) if m.first_token_time is not None else rec.latency
    rec.itl = [b - a for a, b in zip(times, times[1:])]
    rec.success = True


def run_engine(engine, cfg: BenchConfig, requests: list[SampleRequest], load: Load, hooks: Hooks | None = None,
               description: str = "bench") -> RunOutput:
    """One offline run of `requests` under `load` on `engine` (an LLMEngine)."""
    hooks = hooks or Hooks()
    ids = [prompt_ids(engine, cfg, r) for r in requests]
    if cfg.num_warmups:
        hooks.start(f"{description}: warm-up", cfg.num_warmups)
        _drain(engine, [engine.add_request(None, ids[0], sampling_params(cfg, requests[0]))
                        for _ in range(cfg.num_warmups)], hooks)
    stats0 = engine.stats()
    kv: list[float] = []
    hooks.start(description, len(requests) if load.duration is None else None)
    records: list[RequestRecord] = []
    active: dict[str, RequestRecord] = {}
    due = arrivals(load, len(requests))
    next_offset = next(due, None)
    t0 = time.monotonic()
    next_kv = t0
    i = 0
    interrupted = False
    while True:
        now = time.monotonic()
        if hooks.stop.is_set():
            interrupted = True
            break
        if load.duration is not None and now - t0 >= load.duration:
            next_offset = None
        while next_offset is not None and next_offset <= now - t0 and \
                (load.max_concurrency is None or len(active) < load.max_concurrency):
            req = requests[i % len(requests)]
            rec = RequestRecord(req.prompt_len, req.expected_output_len, scheduled_time=next_offset,
                                start_time=now - t0, category=req.category)
            rid = engine.add_request(f"bench-{i}", ids[i % len(requests)], sampling_params(cfg, req),
                                     arrival_time=now)
            active[rid] = rec
            records.append(rec)
            i += 1
            next_offset = next(due, None)
        if now >= next_kv:
            kv.append(engine.stats().kv_cache_usage)
            next_kv = now + cfg.kv_sample_interval
        if not engine.has_unfinished_requests():
            if next_offset is None:
                break
            time.sleep(min(_IDLE, max(next_offset - (time.monotonic() - t0), 0)))
            continue
        for out in engine.step():
            if out.finished and out.request_id in active:
                _record(active.pop(out.request_id), out, t0)
                hooks.advance(1)
    end = time.monotonic()
    if interrupted:
        engine.abort_request(list(active))
        for rec in active.values():
            rec.cancelled = True
    stats1 = engine.stats()
    queries = stats1.prefix_cache_queries - stats0.prefix_cache_queries
    hits = stats1.prefix_cache_hits - stats0.prefix_cache_hits
    server = ServerStats(prefix_cache_queries=queries, prefix_cache_hits=hits,
                         prefix_cache_hit_rate=hits / queries if queries else 0.0,
                         num_preemptions=stats1.num_preemptions - stats0.num_preemptions,
                         kv_offload_hit_tokens=stats1.kv_offload_hit_tokens - stats0.kv_offload_hit_tokens
                         if engine.kv.offload is not None else None,
                         kv_cache_usage_mean=sum(kv) / len(kv) if kv else None,
                         kv_cache_usage_max=max(kv) if kv else None)
    sp0, sp1 = stats0.spec_decoding, stats1.spec_decoding
    if sp1 is not None and sp1.num_drafts > sp0.num_drafts:   # llmopt.speculative counters over this run
        drafts = sp1.num_drafts - sp0.num_drafts
        draft_tokens = sp1.num_draft_tokens - sp0.num_draft_tokens
        accepted = sp1.num_accepted_tokens - sp0.num_accepted_tokens
        server.spec_decode_num_drafts, server.spec_decode_draft_tokens = drafts, draft_tokens
        server.spec_decode_accepted_tokens = accepted
        server.spec_decode_acceptance_rate = 100.0 * accepted / draft_tokens
        server.spec_decode_acceptance_length = 1 + accepted / drafts
        server.spec_decode_per_position_acceptance_rates = [
            (a - b) / drafts for a, b in zip(sp1.num_accepted_tokens_per_pos, sp0.num_accepted_tokens_per_pos)]
    return RunOutput(records, end - t0, server, interrupted)


def _drain(engine, rids: list[str], hooks: Hooks) -> None:
    left = set(rids)
    while left and engine.has_unfinished_requests():
        if hooks.stop.is_set():
            engine.abort_request(list(left))
            return
        for out in engine.step():
            if out.finished and out.request_id in left:
                left.discard(out.request_id)
                hooks.advance(1)


def build_engine(cfg: BenchConfig, progress=None):
    return LLMEngine(cfg.engine_args, progress=progress)


@dataclass
class HFComparison:
    """transformers `generate` on the same prompts: its throughput and ours over it."""
    batch_size: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    output_throughput: float
    total_token_throughput: float
    speedup_output_throughput: float | None = None    # the engine's output throughput / transformers'


def compare_hf(engine, cfg: BenchConfig, requests: list[SampleRequest], batch_size: int,
               hooks: Hooks | None = None) -> HFComparison:
    """Greedy transformers `generate` of each request's length, `batch_size` prompts at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    hooks = hooks or Hooks()
    loaded = engine.loaded
    model = AutoModelForCausalLM.from_pretrained(str(loaded.path), dtype=loaded.dtype).to(loaded.device).eval()
    tok = engine.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    eos = sorted(engine.eos_token_ids)
    ids = [prompt_ids(engine, cfg, r) for r in requests]
    hooks.start("transformers generate", len(requests))
    total_in = total_out = 0
    t0 = time.monotonic()
    for b in range(0, len(requests), batch_size):
        if hooks.stop.is_set():
            break
        batch, reqs = ids[b:b + batch_size], requests[b:b + batch_size]
        width = max(len(x) for x in batch)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch], device=loaded.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch], device=loaded.device)
        new = max(r.expected_output_len for r in reqs)
        kw = dict(max_new_tokens=new, do_sample=False, pad_token_id=pad, temperature=None, top_p=None, top_k=None)
        if cfg.sampling.ignore_eos:
            kw.update(min_new_tokens=new, eos_token_id=None)
        else:
            kw.update(eos_token_id=eos or None)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, **kw)[:, width:].tolist()
        for row, r, x in zip(out, reqs, batch):
            row = row[:r.expected_output_len]
            if not cfg.sampling.ignore_eos:
                stop = next((k for k, t in enumerate(row) if t in engine.eos_token_ids), None)
                row = row if stop is None else row[:stop + 1]
            total_out += len(row)
            total_in += len(x)
        hooks.advance(len(reqs))
    dur = time.monotonic() - t0
    return HFComparison(batch_size, dur, total_in, total_out, total_out / dur if dur else 0.0,
                        (total_in + total_out) / dur if dur else 0.0)
