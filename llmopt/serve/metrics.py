"""Prometheus metrics of the server, with vLLM's names after our own prefix (`llmopt:`), so a vLLM
dashboard works by changing the prefix. Counters get prometheus_client's `_total` suffix, as vLLM's
do. Every metric carries `model_name` and `engine` labels; `request_success` adds `finished_reason`
(stop, length, abort, error). `cache_config_info` is vLLM's info gauge (always 1): the KV cache's
configuration as labels (vLLM's CacheConfig names) and `engine`. prometheus_client's process,
platform and gc collectors (`process_resident_memory_bytes`, `python_info`, `python_gc_*`) come too.

Engine state (running/waiting requests, KV usage, prefix-cache lookups, preemptions) is read from
`LLMEngine.stats()` when /metrics is scraped; `iteration_tokens_total` is observed per engine step
that produced outputs (AsyncLLMEngine's IterationStats); the per-request histograms are recorded as
requests finish, as vLLM counts them: one observation per sample (a prompt of n samples is n
requests to vLLM) of its prompt and generated tokens, max_tokens and phases (queue, prefill, decode,
inference: core/outputs.py RequestMetrics), and one per prompt of `n` and of its longest sample.
Each `ServerMetrics` has its own registry (several servers in one process do not collide)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector,
                               ProcessCollector, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmopt.core.outputs import CompletionOutput, RequestOutput
from llmopt.core.request import max_tokens_limit
from llmopt.core.sampling_params import SamplingParams
from llmopt.engine.async_engine import IterationStats

PREFIX = "llmopt:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_BUCKETS = [1, 2, 5, 10, 20]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets of token counts, to max_model_len)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class _EngineCollector:
    """Reads the engine's state at scrape time."""

    def __init__(self, stats: Callable[[], object], labels: dict[str, str]) -> None:
        self.stats, self.labels = stats, labels

    def collect(self):
        s = self.stats()
        names, values = list(self.labels), list(self.labels.values())
        G, C = GaugeMetricFamily, CounterMetricFamily
        rows = [
            (G, "num_requests_running", "Requests in the running batch.", s.num_running),
            (G, "num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            (G, "kv_cache_usage_perc", "KV-cache usage: 1 = every block in use.", s.kv_cache_usage),
            (C, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            (C, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            (C, "num_preemptions", "Requests preempted for lack of KV blocks.", s.num_preemptions),
            (C, "kv_offload_hit_tokens", "Prompt tokens found in the KV offload tier.", s.kv_offload_hit_tokens),
            (C, "kv_offload_saved_bytes", "Bytes copied from the KV cache into the offload tier.",
             s.kv_offload_saved_bytes),
            (C, "kv_offload_loaded_bytes", "Bytes copied from the offload tier back into the KV cache.",
             s.kv_offload_loaded_bytes),
        ]
        spec = getattr(s, "spec_decoding", None)
        if spec is not None:   # vLLM's spec_decode_* counters; per position with a `position` label
            rows += [
                (C, "spec_decode_num_drafts", "Verifying steps of requests with drafts.", spec.num_drafts),
                (C, "spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens),
                (C, "spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
            ]
        for family, name, doc, value in rows:
            m = family(PREFIX + name, doc, labels=names)
            m.add_metric(values, float(value))
            yield m
        if spec is not None:
            c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted at each draft position.", labels=names + ["position"])
            for pos, value in enumerate(spec.num_accepted_tokens_per_pos):
                c.add_metric(values + [str(pos)], float(value))
            yield c


class _InfoCollector:
    """vLLM's cache_config_info: a gauge at 1 whose labels are the configuration (values as str())."""

    def __init__(self, name: str, doc: str, labels: dict[str, str]) -> None:
        self.name, self.doc, self.labels = name, doc, labels

    def collect(self):
        m = GaugeMetricFamily(self.name, self.doc, labels=list(self.labels))
        m.add_metric(list(self.labels.values()), 1.0)
        yield m


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], object], max_model_len: int,
                 cache_config: dict[str, object] | None = None, engine: str = "0") -> None:
        self.registry = r = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine": engine}
        self.max_model_len = max_model_len
        names = list(self.labels)
        r.register(_EngineCollector(stats, self.labels))
        info = {k: str(v) for k, v in (cache_config or {}).items()} | {"engine": engine}
        r.register(_InfoCollector(PREFIX + "cache_config_info", "Information of the LLMEngine CacheConfig", info))
        for collector in (ProcessCollector, PlatformCollector, GCCollector):   # each registers itself
            collector(registry=r)

        # each metric is held bound to this engine's labels (present at zero from the first scrape, as
        # vLLM's), not looked up per token and per step (labels() costs ~1.5 us a call)
        def hist(name: str, doc: str, buckets: list):
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=r).labels(**self.labels)

        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", names,
                                     registry=r).labels(**self.labels)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", names,
                                         registry=r).labels(**self.labels)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                       names + ["finished_reason"], registry=r)
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Decode time over the output tokens after the first, per request.", ITL_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS)
        self.inference_time = hist("request_inference_time_seconds", "First scheduled to last token.",
                                   LATENCY_BUCKETS)
        tokens = build_1_2_5_buckets(max_model_len)
        self.prompt_hist = hist("request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.generation_hist = hist("request_generation_tokens", "Tokens generated per request.", tokens)
        self.max_tokens_hist = hist("request_params_max_tokens", "The max_tokens request parameter.", tokens)
        self.max_generation_hist = hist("request_max_num_generation_tokens",
                                        "Tokens generated by the longest sample of a prompt.", tokens)
        self.n_hist = hist("request_params_n", "The n request parameter.", N_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens per engine step.", ITERATION_TOKENS_BUCKETS)
        self._success_by_reason = {reason: self.request_success.labels(**self.labels, finished_reason=reason)
                                   for reason in ("stop", "length", "abort", "error")}

    def iteration(self, step: IterationStats) -> None:
        """One engine step's tokens (AsyncLLMEngine's IterationStats): its prompts and generated tokens."""
        self.iteration_tokens.observe(step.num_prompt_tokens + step.num_generation_tokens)

    def finished(self, output: RequestOutput, arrival: float, params: SamplingParams) -> None:
        """Record a finished RequestOutput (`arrival`: time.monotonic() when the server got it;
        `params`: its sampling parameters)."""
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in output.outputs))
        max_tokens = max_tokens_limit(params, len(output.prompt_token_ids), self.max_model_len)
        for c in output.outputs:
            if c.finish_reason:
                self._success(c.finish_reason).inc()
                self._sample(c, len(output.prompt_token_ids), max_tokens, arrival)
        self.n_hist.observe(params.n)
        self.max_generation_hist.observe(max((len(c.token_ids) for c in output.outputs), default=0))

    def _sample(self, c: CompletionOutput, num_prompt_tokens: int, max_tokens: int, arrival: float) -> None:
        """One finished sample, as vLLM records a finished request (its phases from its own timestamps)."""
        self.prompt_hist.observe(num_prompt_tokens)
        self.generation_hist.observe(len(c.token_ids))
        if max_tokens:
            self.max_tokens_hist.observe(max_tokens)
        m = c.metrics
        if m is None:
            return
        for hist, start, end in ((self.ttft, arrival, m.first_token_time), (self.queue_time, arrival,
                                 m.first_scheduled_time), (self.e2e, arrival, m.finished_time)):
            if end is not None:
                hist.observe(max(end - start, 0.0))
        if m.prefill_time is None or m.decode_time is None:   # no token: no phases (vLLM's ScheduledTiming)
            return
        self.prefill_time.observe(m.prefill_time)
        self.decode_time.observe(m.decode_time)
        self.inference_time.observe(m.inference_time)
        if len(c.token_ids) > 1:   # vLLM's request_time_per_output_token: not counting the first token
            self.tpot.observe(m.decode_time / (len(c.token_ids) - 1))

    def aborted(self, num_sequences: int, reason: str = "abort") -> None:
        """Sequences that ended without finishing: request_success{abort} when the client left or the
        server shut down, {error} when the engine failed them (vLLM's FinishReason.ERROR)."""
        if num_sequences:
            self._success(reason).inc(num_sequences)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def _success(self, reason: str):
        """request_success{finished_reason=reason}, bound once per reason."""
        child = self._success_by_reason.get(reason)
        if child is None:
            child = self._success_by_reason[reason] = self.request_success.labels(**self.labels,
                                                                                  finished_reason=reason)
        return child

    def render(self) -> bytes:
        return generate_latest(self.registry)
