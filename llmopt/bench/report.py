"""Benchmark results with vLLM's key names, and what is made of them: CSV rows, plots, and the
deltas against a previous result (`--compare-to`), which fail a CI gate with exit code 4.

`BenchResult.to_dict()` is the JSON of one run, keyed as `vllm bench serve`'s result file: the setup
(`date` as %Y%m%d-%H%M%S, `endpoint_type`, `backend`, `label`, `model_id`, `tokenizer_id`,
`num_prompts`, the --metadata KEY=VALUE pairs, `request_rate` ("inf" when unbounded), `burstiness`,
`max_concurrency`), the metrics (`duration`, `completed`, `failed`, `total_input_tokens`,
`total_output_tokens`, `request_throughput`, `output_throughput`, `total_token_throughput`,
`mean_ttft_ms`, `median_ttft_ms`, `std_ttft_ms`, `p99_ttft_ms`, ... for ttft, tpot, itl and e2el,
`request_goodput`, `max_output_tokens_per_s`, `max_concurrent_requests`) and the per-request lists
(`input_lens`, `output_lens`, `ttfts`, `itls`, `latencies`, `start_times`, `queue_times`,
`generated_texts`, `errors`); besides them llmopt's own: the mode and strategy, the failures by
reason, and the server's view (prefix-cache hit rate, KV usage, speculative acceptance).
mean/median/std are given for all four latency metrics; percentiles for those of
--percentile-metrics. A sweep is `{"benchmarks": [one run's object, ...]}`.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt import fsutil
from llmopt.bench.metrics import METRICS, RequestRecord, ServerStats, Summary, percentile_key
from llmopt.errors import UserInputError

EXIT_REGRESSION = 4   # --compare-to: a metric got worse than --fail-threshold allows
DATE_FORMAT = "%Y%m%d-%H%M%S"   # vLLM's `date` (local time), also in its result file's name


@dataclass
class CategoryStats:
    """One Spec-Bench category (spec_bench workloads)."""
    completed: int
    total_output_tokens: int
    mean_ttft_ms: float
    mean_tpot_ms: float
    mean_itl_ms: float
    mean_e2el_ms: float
    mean_tokens_per_s: float      # Spec-Bench's: the mean over requests of output tokens / E2EL


@dataclass
class BenchResult:
    date: str                                 # DATE_FORMAT
    backend: str                              # vLLM's --backend: openai | openai-chat
    label: str | None
    mode: str                                 # online | offline
    strategy: str                             # single | synchronous | throughput | constant@R
    endpoint: str
    base_url: str | None
    model_id: str | None
    tokenizer_id: str | None
    dataset_name: str
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    duration_limit: float | None
    duration: float                           # seconds: first send to last completion (or Ctrl-C)
    interrupted: bool
    summary: Summary
    percentile_metrics: list[str]
    percentiles: list[float]
    goodput_config: dict[str, float]
    server: ServerStats
    records: list[RequestRecord]
    per_category: dict[str, CategoryStats] | None = None
    compare_hf: Any = None                    # offline.HFComparison with --compare hf
    compare_spec: Any = None                  # spec.bench.SpecComparison with --spec METHOD (offline)
    metadata: dict[str, str] = field(default_factory=dict)   # --metadata

    def to_dict(self) -> dict[str, Any]:
        s = self.summary
        d: dict[str, Any] = {
            "date": self.date, "endpoint_type": self.backend, "backend": self.backend, "label": self.label,
            "mode": self.mode, "strategy": self.strategy, "endpoint": self.endpoint,
            "base_url": self.base_url, "model_id": self.model_id, "tokenizer_id": self.tokenizer_id,
            "dataset_name": self.dataset_name, "num_prompts": self.num_prompts}
        d.update(self.metadata)   # where vLLM merges them: over the keys above, under those below
        d.update({
            "request_rate": self.request_rate, "burstiness": self.burstiness, "max_concurrency": self.max_concurrency,
            "duration_limit": self.duration_limit, "duration": self.duration, "interrupted": self.interrupted,
            "completed": s.completed, "failed": s.failed, "cancelled": s.cancelled,
            "total_input_tokens": s.total_input_tokens, "total_output_tokens": s.total_output_tokens,
            "request_throughput": s.request_throughput, "request_goodput": s.request_goodput,
            "output_throughput": s.output_throughput, "total_token_throughput": s.total_token_throughput,
            "max_output_tokens_per_s": s.max_output_tokens_per_s,
            "max_concurrent_requests": s.max_concurrent_requests,
            "rtfx": 0.0,   # vLLM's inverse real-time factor of speech benchmarks: 0 for text, as there
        })
        for m in METRICS:
            st = s.stats[m]
            d[f"mean_{m}_ms"], d[f"median_{m}_ms"], d[f"std_{m}_ms"] = st.mean, st.median, st.std
            if m in self.percentile_metrics:
                for p, v in st.percentiles.items():
                    d[percentile_key(p, m)] = v
        d["goodput_config"] = dict(self.goodput_config)
        d["failed_reasons"] = dict(s.failed_reasons)
        d.update(dataclasses.asdict(self.server))
        d["per_category"] = None if self.per_category is None else \
            {k: dataclasses.asdict(v) for k, v in self.per_category.items()}
        d["compare_hf"] = None if self.compare_hf is None else dataclasses.asdict(self.compare_hf)
        d["compare_spec"] = None if self.compare_spec is None else dataclasses.asdict(self.compare_spec)
        d["input_lens"] = [r.prompt_len for r in self.records]
        d["output_lens"] = list(s.output_lens)
        d["ttfts"] = [r.ttft for r in self.records]
        d["itls"] = [list(r.itl) for r in self.records]
        d["latencies"] = [r.latency for r in self.records]
        d["start_times"] = [r.start_time for r in self.records]
        d["queue_times"] = [r.queue_time for r in self.records]
        d["generated_texts"] = [r.generated_text for r in self.records]
        d["errors"] = [r.error for r in self.records]
        return d


@dataclass
class BenchReport:
    """What `llmopt bench` hands back: one result, or a sweep's."""
    results: list[BenchResult]
    sweep: bool = False
    comparison: "Comparison | None" = None

    @property
    def interrupted(self) -> bool:
        return any(r.interrupted for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        if self.sweep:
            d: dict[str, Any] = {"benchmarks": [r.to_dict() for r in self.results]}
        else:
            d = self.results[0].to_dict()
        d["comparison"] = None if self.comparison is None else dataclasses.asdict(self.comparison)
        return d


def category_stats(records: list[RequestRecord], output_lens: list[int]) -> dict[str, CategoryStats] | None:
    cats = sorted({r.category for r in records if r.category is not None})
    if not cats:
        return None
    out = {}
    for cat in cats:
        rows = [(r, n) for r, n in zip(records, output_lens) if r.category == cat and r.success]

        def mean(xs):
            xs = list(xs)
            return 1000 * sum(xs) / len(xs) if xs else 0.0
        itls = [g for r, _ in rows for g in r.itl]
        tps = [n / r.latency for r, n in rows if r.latency > 0]
        out[cat] = CategoryStats(len(rows), sum(n for _, n in rows), mean(r.ttft for r, _ in rows),
                                 mean((r.latency - r.ttft) / (n - 1) for r, n in rows if n > 1), mean(itls),
                                 mean(r.latency for r, _ in rows), sum(tps) / len(tps) if tps else 0.0)
    return out


# -- files ---------------------------------------------------------------------------------------------
def scalar_rows(report_dict: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per benchmark of the scalar keys (lists and nested objects left out)."""
    items = report_dict.get("benchmarks") or [report_dict]
    return [{k: v for k, v in d.items() if not isinstance(v, (list, dict))} for d in items]


def to_csv(report_dict: dict[str, Any]) -> str:
    rows = scalar_rows(report_dict)
    columns = list(dict.fromkeys(k for row in rows for k in row))   # every key, in first-seen order
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserInputError("--plot needs matplotlib: pip install 'llmopt[plot]' (or pip install matplotlib)") \
            from None


def plot(report: BenchReport, path: str | Path) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2EL) of each run; for a sweep also throughput and latency
    against the achieved request rate. Written as a PNG."""
    check_matplotlib()
    import matplotlib   # deferred: matplotlib is optional (llmopt[plot]), needed for --plot only
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    results = report.results
    sweep = report.sweep and len(results) > 1
    fig, axes = plt.subplots(2 if sweep else 1, 4, figsize=(14, 6.5 if sweep else 3.4), squeeze=False)
    for ax, m in zip(axes[0], METRICS):
        for res in results:
            vals = _per_request(res, m)
            if vals:
                xs = np.sort(np.asarray(vals) * 1000)
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=res.strategy)
        ax.set_title(f"{m.upper()} CDF")
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    if len(results) > 1 or results[0].strategy != "single":
        axes[0][0].legend(fontsize=7)
    if sweep:
        x = [r.summary.request_throughput for r in results]
        order = np.argsort(x)
        pts = [(x[i], results[i]) for i in order]
        panels = [("output tok/s", lambda r: r.summary.output_throughput),
                  ("mean TTFT (ms)", lambda r: r.summary.stats["ttft"].mean),
                  ("mean TPOT (ms)", lambda r: r.summary.stats["tpot"].mean),
                  ("mean E2EL (ms)", lambda r: r.summary.stats["e2el"].mean)]
        for ax, (title, f) in zip(axes[1], panels):
            ax.plot([p for p, _ in pts], [f(r) for _, r in pts], marker="o")
            ax.set_title(title + " vs load")
            ax.set_xlabel("achieved requests/s")
            ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    tmp = fsutil.temp_path(path)
    try:
        fig.savefig(tmp, format="png", dpi=80)
        fsutil.apply_umask(tmp)
        tmp.replace(path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def _per_request(res: BenchResult, metric: str) -> list[float]:
    ok = [(r, n) for r, n in zip(res.records, res.summary.output_lens) if r.success]
    if metric == "ttft":
        return [r.ttft for r, _ in ok]
    if metric == "e2el":
        return [r.latency for r, _ in ok]
    if metric == "tpot":
        return [(r.latency - r.ttft) / (n - 1) for r, n in ok if n > 1]
    return [g for r, _ in ok for g in r.itl]


# -- --compare-to ----------------------------------------------------------------------------------------
HIGHER_IS_BETTER = ("request_throughput", "request_goodput", "output_throughput", "total_token_throughput")
_LATENCY_KEY = re.compile(r"^(mean|median|p[0-9.]+)_(ttft|tpot|itl|e2el)_ms$")


@dataclass
class Delta:
    benchmark: str
    metric: str
    previous: float
    current: float
    change_pct: float | None        # (current − previous) / previous · 100; None when previous is 0
    better: str                     # "higher" or "lower"
    regressed: bool


@dataclass
class Comparison:
    previous_file: str
    fail_threshold_pct: float
    deltas: list[Delta] = field(default_factory=list)

    @property
    def regressions(self) -> list[Delta]:
        return [d for d in self.deltas if d.regressed]


def load_previous(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserInputError(f"--compare-to {path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserInputError(f"--compare-to {path}: not a JSON file ({e})") from None
    if not isinstance(data, dict) or not ("benchmarks" in data or "request_throughput" in data):
        raise UserInputError(f"--compare-to {path}: not an `llmopt bench --output` result")
    return data


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, str) and v in ("inf", "-inf"):
        return float(v)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def comparable_metrics(names: str | None) -> tuple[str, ...] | None:
    """--compare-metrics: the comma-separated metrics --compare-to checks (None: all of them)."""
    if names is None:
        return None
    chosen = tuple(n.strip() for n in names.split(",") if n.strip())
    bad = [n for n in chosen if n not in HIGHER_IS_BETTER and not _LATENCY_KEY.match(n)]
    if bad or not chosen:
        raise UserInputError(f"--compare-metrics {names!r}: give throughputs ({', '.join(HIGHER_IS_BETTER)}) or "
                             "latencies such as mean_tpot_ms, median_ttft_ms, p99_itl_ms, comma-separated")
    return chosen


def _compare_one(name: str, prev: dict, cur: dict, threshold: float, only: tuple[str, ...] | None) -> list[Delta]:
    out = []
    keys = [k for k in HIGHER_IS_BETTER] + [k for k in cur if _LATENCY_KEY.match(k)]
    if only is not None:
        keys = [k for k in keys if k in only]
    for k in keys:
        a, b = _num(prev.get(k)), _num(cur.get(k))
        if a is None or b is None:
            continue
        higher = k in HIGHER_IS_BETTER
        change = (b - a) / a * 100 if a else None
        if change is None:
            worse = (b < a) if higher else (b > a)
        else:
            worse = change < -threshold if higher else change > threshold
        out.append(Delta(name, k, a, b, change, "higher" if higher else "lower", worse))
    a, b = prev.get("failed"), cur.get("failed")
    if isinstance(a, int) and isinstance(b, int):
        out.append(Delta(name, "failed", a, b, (b - a) / a * 100 if a else None, "lower", b > a))
    return out


def compare(previous: dict[str, Any], current: dict[str, Any], threshold_pct: float, previous_file: str,
            only: tuple[str, ...] | None = None) -> Comparison:
    """Deltas of the throughputs (higher is better), the mean/median/percentile latencies (lower is
    better) and the failed count between two results; a metric regresses when it is worse by more
    than `threshold_pct` percent (failed: any increase). `only`: the metrics to compare (and failed)."""
    if not threshold_pct >= 0:
        raise UserInputError(f"--fail-threshold {threshold_pct}: use a percentage >= 0")
    comp = Comparison(previous_file, threshold_pct)
    prev_runs = previous.get("benchmarks") or [previous]
    cur_runs = current.get("benchmarks") or [current]
    if len(prev_runs) != len(cur_runs):
        raise UserInputError(f"--compare-to {previous_file}: it holds {len(prev_runs)} benchmark(s), this run "
                             f"{len(cur_runs)}: compare like with like")
    for p, c in zip(prev_runs, cur_runs):
        comp.deltas += _compare_one(str(c.get("strategy", "single")), p, c, threshold_pct, only)
    return comp
