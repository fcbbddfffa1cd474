"""Prometheus metrics of the server, with vLLM's names after our own prefix (`llmopt:`), so a vLLM
dashboard works by changing the prefix. Counters get prometheus_client's `_total` suffix, as vLLM's
do. Every metric carries `model_name` and `engine` labels; `request_success` adds `finished_reason`
(stop, length, abort, error).

Engine state (running/waiting requests, KV usage, prefix-cache lookups, preemptions) is read from
`LLMEngine.stats()` when /metrics is scraped; request counts and latencies are recorded by the
server as requests finish. Each `ServerMetrics` has its own registry (several servers in one
process do not collide)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "llmopt:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]


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


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], object], engine: str = "0") -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine": engine}
        names = list(self.labels)
        self.registry.register(_EngineCollector(stats, self.labels))
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", names, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", names, registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                       names + ["finished_reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", names,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens.", names,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish.", names,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "request_time_per_output_token_seconds",
                              "Decode time over the output tokens after the first, per request.", names,
                              buckets=ITL_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to first scheduled.", names,
                                    buckets=LATENCY_BUCKETS, registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(**self.labels, finished_reason=reason)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e, self.tpot,
                       self.queue_time):   # present (at zero) from the first scrape, as vLLM's
            metric.labels(**self.labels)

    def finished(self, output, arrival: float) -> None:
        """Record a finished RequestOutput (`arrival`: time.monotonic() when the server got it)."""
        lb = self.labels
        self.prompt_tokens.labels(**lb).inc(len(output.prompt_token_ids))
        self.generation_tokens.labels(**lb).inc(sum(len(c.token_ids) for c in output.outputs))
        for c in output.outputs:
            if c.finish_reason:
                self.request_success.labels(**lb, finished_reason=c.finish_reason).inc()
        m = output.metrics
        if m is not None:
            if m.first_token_time is not None:
                self.ttft.labels(**lb).observe(max(m.first_token_time - arrival, 0.0))
            if m.first_scheduled_time is not None:
                self.queue_time.labels(**lb).observe(max(m.first_scheduled_time - arrival, 0.0))
            if m.finished_time is not None:
                self.e2e.labels(**lb).observe(max(m.finished_time - arrival, 0.0))
            # vLLM's request_time_per_output_token: decode time over the tokens after the first (with
            # n > 1 the samples decode side by side: the longest one's tokens)
            n = max((len(c.token_ids) for c in output.outputs), default=0)
            if m.first_token_time is not None and m.finished_time is not None and n > 1:
                self.tpot.labels(**lb).observe(max(m.finished_time - m.first_token_time, 0.0) / (n - 1))

    def aborted(self, num_sequences: int, reason: str = "abort") -> None:
        """Sequences that ended without finishing: request_success{abort} when the client left or the
        server shut down, {error} when the engine failed them (vLLM's FinishReason.ERROR)."""
        if num_sequences:
            self.request_success.labels(**self.labels, finished_reason=reason).inc(num_sequences)

    def inter_token(self, seconds: float) -> None:
        self.itl.labels(**self.labels).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
