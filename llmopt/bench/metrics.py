"""Benchmark metrics with vLLM's definitions (vllm/benchmarks/serve.py).

Per successful request: TTFT = first token − send; E2EL = last token − send; TPOT = (E2EL − TTFT)
/ (output tokens − 1) for requests of more than one token (the first token excluded); ITL = the gaps
between successive token arrivals (a chunk carrying several tokens is one arrival). Over the run
(duration: first send to last completion): request throughput = completed / duration, output
throughput = output tokens / duration, total token throughput = (input + output tokens) /
duration; goodput = requests meeting every --goodput SLO (a TPOT of 0 for one-token requests, as
vLLM) / duration. Statistics: mean, median, standard deviation (numpy's, population) and numpy's
linearly interpolated percentiles, in milliseconds. Output tokens are the server's count (usage)
when it reports one, else the generated text re-tokenized, as vLLM.

Also the server's own view, from Prometheus text (`/metrics`) under any prefix (`llmopt:`,
`vllm:`): prefix-cache queries and hits and speculative-decoding counters differenced over the run,
and the KV-cache usage gauge sampled while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from llmopt.errors import UserInputError

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What one request did, times in seconds (start_time from the benchmark's start)."""
    prompt_len: int
    expected_output_len: int
    success: bool = False
    error: str = ""
    start_time: float = 0.0          # sent (after any wait for a concurrency slot)
    scheduled_time: float = 0.0      # due by the schedule
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0             # E2EL
    output_tokens: int | None = None  # the server's count (usage), when it gave one
    generated_text: str = ""
    category: str | None = None
    cancelled: bool = False          # stopped by Ctrl-C before it finished

    @property
    def queue_time(self) -> float:
        return max(self.start_time - self.scheduled_time, 0.0)


@dataclass
class Stats:
    mean: float
    median: float
    std: float
    percentiles: dict[float, float]


@dataclass
class Summary:
    completed: int
    failed: int
    cancelled: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    stats: dict[str, Stats]                 # ttft, tpot, itl, e2el (milliseconds)
    output_lens: list[int]                  # per request (0 for a failed one)
    failed_reasons: dict[str, int]


def parse_percentiles(text: str) -> list[float]:
    """--metric-percentiles: comma-separated numbers in [0, 100]."""
    try:
        ps = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise UserInputError(f"--metric-percentiles {text!r}: give numbers separated by commas, e.g. 50,90,99") \
            from None
    if not ps or any(not 0 <= p <= 100 for p in ps):
        raise UserInputError(f"--metric-percentiles {text!r}: each must be in [0, 100]")
    return ps


def parse_metric_names(text: str) -> list[str]:
    """--percentile-metrics: a comma-separated subset of ttft,tpot,itl,e2el."""
    names = [x.strip() for x in str(text).split(",") if x.strip()]
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise UserInputError(f"--percentile-metrics {text!r}: use names from {','.join(METRICS)}")
    return names


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """--goodput ttft:MS tpot:MS e2el:MS (several items, or one with spaces or commas) -> {name: ms}."""
    out: dict[str, float] = {}
    for item in items or []:
        for pair in str(item).replace(",", " ").split():
            name, sep, value = pair.partition(":")
            try:
                ms = float(value)
            except ValueError:
                ms = None
            if not sep or ms is None:
                raise UserInputError(f"--goodput {pair!r}: give NAME:MILLISECONDS pairs, e.g. ttft:500 tpot:50")
            if name not in GOODPUT_METRICS:
                raise UserInputError(f"--goodput {pair!r}: the SLO names are {', '.join(GOODPUT_METRICS)}")
            if not (ms >= 0):
                raise UserInputError(f"--goodput {pair!r}: the SLO must be >= 0 milliseconds")
            out[name] = ms
    return out


def percentile_key(p: float, metric: str) -> str:
    """vLLM's key: p99_ttft_ms, p99.9_itl_ms."""
    word = str(int(p)) if int(p) == p else str(p)
    return f"p{word}_{metric}_ms"


def _stats(values: list[float], percentiles: list[float]) -> Stats:
    xs = np.asarray(values or [0.0], dtype=float) * 1000
    return Stats(float(np.mean(xs)), float(np.median(xs)), float(np.std(xs)),
                 {p: float(np.percentile(xs, p)) for p in percentiles})


def output_len(rec: RequestRecord, tokenizer) -> int:
    if rec.output_tokens is not None:
        return rec.output_tokens
    if tokenizer is not None:
        return len(tokenizer(rec.generated_text, add_special_tokens=False).input_ids)
    return len(rec.itl) + 1 if rec.success else 0


def summarize(records: list[RequestRecord], duration: float, tokenizer=None, percentiles: list[float] = (99.0,),
              goodput: dict[str, float] | None = None) -> Summary:
    """The run's metrics from its records (see the module doc)."""
    ok = [r for r in records if r.success]
    lens = [output_len(r, tokenizer) if r.success else 0 for r in records]
    ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], []
    for r, n in zip(records, lens):
        if not r.success:
            continue
        ttfts.append(r.ttft)
        e2els.append(r.latency)
        itls.extend(r.itl)
        tpot = (r.latency - r.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
    good = None
    if goodput:
        columns = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        good = sum(all(columns[k][i] <= v / 1000 for k, v in goodput.items()) for i in range(len(ok)))
    reasons: dict[str, int] = {}
    for r in records:
        if not r.success and not r.cancelled:
            reasons[r.error or "unknown error"] = reasons.get(r.error or "unknown error", 0) + 1
    dur = duration if duration > 0 else float("nan")
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(lens)
    peak_tokens, peak_conc = _peaks(ok)
    return Summary(
        completed=len(ok), failed=sum(1 for r in records if not r.success and not r.cancelled),
        cancelled=sum(1 for r in records if r.cancelled), total_input_tokens=total_in,
        total_output_tokens=total_out, request_throughput=len(ok) / dur,
        request_goodput=None if good is None else good / dur, output_throughput=total_out / dur,
        total_token_throughput=(total_in + total_out) / dur, max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_conc,
        stats={"ttft": _stats(ttfts, percentiles), "tpot": _stats(tpots, percentiles),
               "itl": _stats(itls, percentiles), "e2el": _stats(e2els, percentiles)},
        output_lens=lens, failed_reasons=reasons)


def _peaks(ok: list[RequestRecord]) -> tuple[float, int]:
    """Most token arrivals in one second of the run, and most requests in flight at once."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    buckets: dict[int, int] = {}
    events = []
    for r in ok:
        t = r.start_time + r.ttft
        for gap in [0.0, *r.itl]:
            t += gap
            b = int(t - t0)
            buckets[b] = buckets.get(b, 0) + 1
        events += [(r.start_time, 1), (r.start_time + r.latency, -1)]
    events.sort()
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return float(max(buckets.values())), peak


# -- the server's /metrics -------------------------------------------------------------------------------
_COUNTERS = {
    "prefix_cache_queries": "prefix_cache_queries", "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions": "num_preemptions", "kv_offload_hit_tokens": "kv_offload_hit_tokens",
    "spec_decode_num_drafts": "spec_num_drafts",
    "spec_decode_num_draft_tokens": "spec_draft_tokens", "spec_decode_num_accepted_tokens": "spec_accepted_tokens",
}
_KV_GAUGES = ("kv_cache_usage_perc", "gpu_cache_usage_perc")
_HISTOGRAMS = {"request_time_per_output_token_seconds": "tpot"}   # their _sum and _count, as tpot_sum, tpot_count


@dataclass
class ServerCounters:
    """Counter values read from one scrape (summed over label sets), by our short name."""
    values: dict[str, float] = field(default_factory=dict)
    accepted_per_pos: dict[int, float] = field(default_factory=dict)
    kv_usage: float | None = None


def parse_prometheus(text: str) -> ServerCounters:
    from prometheus_client.parser import text_string_to_metric_families
    out = ServerCounters()
    kv = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name.rsplit(":", 1)[-1]
            base = name[:-len("_total")] if name.endswith("_total") else None
            if base == "spec_decode_num_accepted_tokens_per_pos" and "position" in s.labels:
                pos = int(s.labels["position"])
                out.accepted_per_pos[pos] = out.accepted_per_pos.get(pos, 0.0) + s.value
            elif base in _COUNTERS:
                key = _COUNTERS[base]
                out.values[key] = out.values.get(key, 0.0) + s.value
            elif name in _KV_GAUGES:
                kv.append(s.value)
            elif name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in _HISTOGRAMS:
                stem, part = name.rsplit("_", 1)
                key = f"{_HISTOGRAMS[stem]}_{part}"
                out.values[key] = out.values.get(key, 0.0) + s.value
    if kv:
        out.kv_usage = float(np.mean(kv))
    return out


@dataclass
class ServerStats:
    """The server's (or the engine's) view over the run; None: it did not say."""
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    prefix_cache_hit_rate: float | None = None
    num_preemptions: int | None = None
    kv_offload_hit_tokens: int | None = None   # prompt tokens found in the KV offload tier (within the hits)
    kv_cache_usage_mean: float | None = None
    kv_cache_usage_max: float | None = None
    spec_decode_num_drafts: int | None = None
    spec_decode_draft_tokens: int | None = None
    spec_decode_accepted_tokens: int | None = None
    spec_decode_acceptance_rate: float | None = None       # percent, as vLLM
    spec_decode_acceptance_length: float | None = None     # 1 + accepted / drafts
    spec_decode_per_position_acceptance_rates: list[float] | None = None
    server_mean_tpot_ms: float | None = None   # the server's request_time_per_output_token over the run


def server_stats(before: ServerCounters | None, after: ServerCounters | None,
                 kv_samples: list[float]) -> ServerStats:
    st = ServerStats()
    if kv_samples:
        st.kv_cache_usage_mean = float(np.mean(kv_samples))
        st.kv_cache_usage_max = float(np.max(kv_samples))
    if before is None or after is None:
        return st

    def diff(key: str) -> int | None:
        if key not in after.values:
            return None
        return int(round(after.values[key] - before.values.get(key, 0.0)))

    st.prefix_cache_queries, st.prefix_cache_hits = diff("prefix_cache_queries"), diff("prefix_cache_hits")
    if st.prefix_cache_queries and st.prefix_cache_hits is not None:
        st.prefix_cache_hit_rate = st.prefix_cache_hits / st.prefix_cache_queries
    elif st.prefix_cache_queries == 0:
        st.prefix_cache_hit_rate = 0.0
    st.num_preemptions = diff("num_preemptions")
    st.kv_offload_hit_tokens = diff("kv_offload_hit_tokens")
    if "tpot_count" in after.values:   # float sums: not through diff's rounding
        n = after.values["tpot_count"] - before.values.get("tpot_count", 0.0)
        if n > 0:
            st.server_mean_tpot_ms = 1000 * (after.values["tpot_sum"] - before.values.get("tpot_sum", 0.0)) / n
    drafts, draft_tokens, accepted = diff("spec_num_drafts"), diff("spec_draft_tokens"), diff("spec_accepted_tokens")
    if draft_tokens:
        st.spec_decode_num_drafts, st.spec_decode_draft_tokens, st.spec_decode_accepted_tokens = \
            drafts, draft_tokens, accepted
        st.spec_decode_acceptance_rate = 100.0 * (accepted or 0) / draft_tokens
        st.spec_decode_acceptance_length = 1 + (accepted or 0) / drafts if drafts else None
        if drafts:
            st.spec_decode_per_position_acceptance_rates = [
                (after.accepted_per_pos.get(p, 0.0) - before.accepted_per_pos.get(p, 0.0)) / drafts
                for p in sorted(after.accepted_per_pos)]
    return st
