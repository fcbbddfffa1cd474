"""`run_benchmark(config)`: resolve the target (a server, or the engine in-process), build the
workload once, run one benchmark or a sweep on it, and return a BenchReport."""

from __future__ import annotations

import datetime
from dataclasses import replace

from llmopt.bench.config import BenchConfig, Hooks, RunOutput
from llmopt.bench.datasets import load_tokenizer, sample_requests
from llmopt.bench.metrics import summarize
from llmopt.bench.report import DATE_FORMAT, BenchReport, BenchResult, category_stats
from llmopt.bench.schedule import Load, sweep_loads, synchronous, throughput
from llmopt.errors import LLMOptError, UserInputError


def _online_tokenizer(cfg: BenchConfig, target):
    """--tokenizer, else --model, else the model the server names (its /v1/models root, then id)."""
    if cfg.tokenizer:
        return load_tokenizer(cfg.tokenizer), cfg.tokenizer
    tried = []
    for name in [n for n in (cfg.model, target.model_root, target.model) if n]:
        try:
            return load_tokenizer(name), name
        except LLMOptError as e:
            tried.append(f"{name} ({e})")
    raise UserInputError("no tokenizer for the workload: give --tokenizer NAME_OR_PATH (tried "
                         + "; ".join(tried) + ")")


def result_of(cfg: BenchConfig, run: RunOutput, load: Load, tokenizer, model_id: str | None,
              tokenizer_id: str | None) -> BenchResult:
    """A run's BenchResult: its metrics (vLLM's definitions) and the setup it ran under."""
    summary = summarize(run.records, run.duration, tokenizer, cfg.percentiles, cfg.goodput)
    return BenchResult(
        date=datetime.datetime.now().strftime(DATE_FORMAT), backend=cfg.backend, label=cfg.label,
        metadata=dict(cfg.metadata), mode="online" if cfg.online else "offline", strategy=load.label, endpoint=cfg.endpoint,
        base_url=cfg.base_url, model_id=model_id, tokenizer_id=tokenizer_id,
        dataset_name=cfg.workload.dataset_name, num_prompts=len(run.records), request_rate=load.request_rate,
        burstiness=load.burstiness, max_concurrency=load.max_concurrency, duration_limit=load.duration,
        duration=run.duration, interrupted=run.interrupted, summary=summary,
        percentile_metrics=list(cfg.percentile_metrics), percentiles=list(cfg.percentiles),
        goodput_config=dict(cfg.goodput), server=run.server, records=run.records,
        per_category=category_stats(run.records, summary.output_lens))


def run_benchmark(cfg: BenchConfig, hooks: Hooks | None = None, progress=None) -> BenchReport:
    """Run what `cfg` asks for. `progress` is the model loader's callback (offline)."""
    hooks = hooks or Hooks()
    # deferred imports here (start-up time, optional dependencies): a run against a server never loads
    # the engine (torch), an offline run never needs the HTTP client, and the speculative and
    # transformers comparisons load what only they use
    if cfg.online:
        from llmopt.bench.online import resolve_target, run_online   # deferred: aiohttp, online only
        target = resolve_target(cfg)
        tokenizer, tokenizer_id = _online_tokenizer(cfg, target)
        model_id = target.model

        def run(requests, load, description):
            return run_online(cfg, target, requests, load, hooks, description)
    else:
        from llmopt.bench.offline import build_engine, run_engine   # deferred: the engine (torch), offline only
        engine = build_engine(cfg, progress)
        tokenizer = engine.tokenizer
        model_id = tokenizer_id = str(cfg.engine_args.model or engine.loaded.path)
        if tokenizer is None:
            raise UserInputError(f"{engine.loaded.path} has no tokenizer: the benchmark builds text prompts")

        def run(requests, load, description):
            return run_engine(engine, cfg, requests, load, hooks, description)

    requests = sample_requests(cfg.workload, tokenizer)
    results: list[BenchResult] = []

    def one(load: Load, description: str) -> BenchResult:
        res = result_of(cfg, run(requests, load, description), load, tokenizer, model_id, tokenizer_id)
        results.append(res)
        return res

    if not cfg.sweep:
        one(cfg.load, "bench")
    else:
        base = replace(cfg.load, strategy="single")
        sync = one(synchronous(base), "sweep synchronous")
        if not hooks.stop.is_set():
            thr = one(throughput(base), "sweep throughput")
            for load in sweep_loads(base, sync.summary.request_throughput, thr.summary.request_throughput,
                                    cfg.sweep_size):
                if hooks.stop.is_set():
                    break
                one(load, f"sweep {load.label} req/s")
    if cfg.spec != "none" and not cfg.online and not hooks.stop.is_set():   # the same prompts without speculation
        from llmopt.bench.speculative import compare_plain   # deferred: for --spec only
        res = next((r for r in results if r.strategy == "throughput"), results[-1])
        load = throughput(replace(cfg.load, strategy="single")) if cfg.sweep else cfg.load
        res.compare_spec = compare_plain(engine, cfg, requests, load, hooks, res, run_engine,
                                         lambda run: result_of(cfg, run, load, tokenizer, model_id, tokenizer_id))
    if cfg.compare_hf and not hooks.stop.is_set():
        from llmopt.bench.offline import compare_hf   # deferred: the engine (torch), --compare-hf only
        res = next((r for r in results if r.strategy == "throughput"), results[-1])   # a sweep: its throughput run
        hf = compare_hf(engine, cfg, requests, cfg.load.max_concurrency or len(requests), hooks)
        if hf.output_throughput:
            hf.speedup_output_throughput = res.summary.output_throughput / hf.output_throughput
        res.compare_hf = hf
    return BenchReport(results, sweep=cfg.sweep)
