"""`llmopt bench`: serving benchmarks with `vllm bench serve`'s flags and metrics, a drop-in for it.
Online against any OpenAI-compatible server (--base-url, or --host/--port/--backend as vLLM), offline
on the engine in-process (none of those). A table, or JSON (--json, --output), vLLM's result file
(--save-result), CSV (--csv), a plot (--plot), and a CI gate (--compare-to: exit 4 when a metric
regresses beyond --fail-threshold). Ctrl-C stops sending, reports what completed, exits 130."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich import box
from rich.table import Table

from llmopt import defaults
from llmopt.cli import common, output
from llmopt.cli.ranges import in_range
from llmopt.errors import UserInputError
from llmopt.validate import SEED_MAX, SEED_MIN

INF = float("inf")

# Shown under Examples in --help (app.py registers the command); one short line each.
EXAMPLES = [
    "llmopt bench --base-url http://127.0.0.1:8000 --num-prompts 200",
    "llmopt bench --base-url URL --request-rate 4 --max-concurrency 16",
    "llmopt bench --model smollm2-135m --num-prompts 16 --ignore-eos",
    "llmopt bench --base-url URL --sweep --plot sweep.png -o sweep.json",
    "llmopt bench --base-url URL -o new.json --compare-to old.json",
    "llmopt bench --backend openai-chat --port 8000 --save-result --metadata tp=1",
]

# vLLM's multi-value flags: `--metadata a=1 b=2`, `--goodput ttft:500 tpot:50` (argparse's nargs)
COMMAND_CLS = output.nargs_command({"--metadata": "*", "--goodput": "+"})

class _Bars:
    """A rich progress bar on stderr per stage (warm-up, each benchmark of a sweep)."""

    def __init__(self, enabled: bool) -> None:
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TimeRemainingColumn(), console=output.err) if enabled else None
        self.task = None

    def __enter__(self) -> "_Bars":
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def start(self, description: str, total: int | None) -> None:
        if self.bar is not None:
            if self.task is not None:
                self.bar.update(self.task, visible=False)
            self.task = self.bar.add_task(description, total=total)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.advance(self.task, n)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.2f}"


def _result_tables(d: dict[str, Any]) -> list[Table]:
    title = "Serving Benchmark Result" if d["mode"] == "online" else "Offline Benchmark Result (engine in-process)"
    rows: list[tuple[str, Any]] = [("Successful requests", d["completed"]), ("Failed requests", d["failed"])]
    if d["cancelled"]:
        rows.append(("Cancelled by Ctrl-C", d["cancelled"]))
    if d["max_concurrency"] is not None:
        rows.append(("Maximum request concurrency", d["max_concurrency"]))
    if d["request_rate"] != INF:
        rows.append(("Request rate configured (RPS)", d["request_rate"]))
    rows += [("Benchmark duration (s)", d["duration"]), ("Total input tokens", d["total_input_tokens"]),
             ("Total generated tokens", d["total_output_tokens"]),
             ("Request throughput (req/s)", d["request_throughput"])]
    if d["request_goodput"] is not None:
        rows.append(("Request goodput (req/s)", d["request_goodput"]))
    rows += [("Output token throughput (tok/s)", d["output_throughput"]),
             ("Peak output token throughput (tok/s)", d["max_output_tokens_per_s"]),
             ("Peak concurrent requests", d["max_concurrent_requests"]),
             ("Total token throughput (tok/s)", d["total_token_throughput"])]
    names = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
    for m, label in names.items():
        pkeys = [k for k in d if k.startswith("p") and k.endswith(f"_{m}_ms")]
        if not pkeys:
            continue
        rows += [(f"Mean {label} (ms)", d[f"mean_{m}_ms"]), (f"Median {label} (ms)", d[f"median_{m}_ms"])]
        rows += [(f"{k.split('_')[0].upper()} {label} (ms)", d[k]) for k in pkeys]
    server = [("Prefix cache hit rate", d["prefix_cache_hit_rate"]), ("KV cache usage mean", d["kv_cache_usage_mean"]),
              ("KV cache usage max", d["kv_cache_usage_max"]), ("Preemptions", d["num_preemptions"]),
              ("KV offload tier hit tokens", d.get("kv_offload_hit_tokens")),
              ("Spec acceptance rate (%)", d["spec_decode_acceptance_rate"]),
              ("Spec acceptance length", d["spec_decode_acceptance_length"]),
              ("Server mean TPOT (ms)", d["server_mean_tpot_ms"])]
    rows += [(k, v) for k, v in server if v is not None]
    tables = [output.kv_table(title, rows)]
    if d["failed_reasons"]:
        t = Table(title="Failed requests by reason", title_justify="left")
        t.add_column("count", justify="right")
        t.add_column("reason")
        for reason, n in sorted(d["failed_reasons"].items(), key=lambda x: -x[1]):
            t.add_row(str(n), reason)
        tables.append(t)
    if d["per_category"]:
        t = Table(title="Per category", title_justify="left")
        for col in ("category", "completed", "out tokens", "mean TTFT ms", "mean TPOT ms", "mean ITL ms",
                    "mean E2EL ms", "tok/s per req"):
            t.add_column(col, justify="left" if col == "category" else "right")
        for cat, c in d["per_category"].items():
            t.add_row(cat, str(c["completed"]), str(c["total_output_tokens"]), _ms(c["mean_ttft_ms"]),
                      _ms(c["mean_tpot_ms"]), _ms(c["mean_itl_ms"]), _ms(c["mean_e2el_ms"]),
                      _ms(c["mean_tokens_per_s"]))
        tables.append(t)
    if d.get("compare_spec"):
        c = d["compare_spec"]
        per = c["acceptance_rate_per_pos"]
        tables.append(output.kv_table(f"Speculative decoding ({c['method']}, K={c['num_speculative_tokens']}) vs "
                                      "plain on the same prompts", [
            ("Plain output throughput (tok/s)", c["plain_output_throughput"]),
            ("Spec output throughput (tok/s)", c["spec_output_throughput"]),
            ("Speedup", c["speedup"]), ("Acceptance length", c["acceptance_length"]),
            ("Acceptance rate per position", " ".join(f"{x:.2f}" for x in per) if per else None),
            ("Greedy outputs identical", c["outputs_identical"])]))
    if d["compare_hf"]:
        h = d["compare_hf"]
        tables.append(output.kv_table("transformers generate on the same prompts", [
            ("Batch size", h["batch_size"]), ("Duration (s)", h["duration"]),
            ("Output token throughput (tok/s)", h["output_throughput"]),
            ("Total token throughput (tok/s)", h["total_token_throughput"]),
            ("Engine / transformers (output tok/s)", h["speedup_output_throughput"])]))
    return tables


def _sweep_table(d: dict[str, Any]) -> Table:
    """One row per benchmark; the percentiles and the rest are in the JSON (--json, --output)."""
    t = Table(title=f"Sweep ({d['benchmarks'][0]['mode']})", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("strategy", "req/s", "out tok/s", "TTFT ms", "TPOT ms", "E2EL ms", "failed"):
        t.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    for b in d["benchmarks"]:
        t.add_row(b["strategy"], f"{b['request_throughput']:.2f}", f"{b['output_throughput']:.1f}",
                  f"{b['mean_ttft_ms']:.0f}", f"{b['mean_tpot_ms']:.1f}", f"{b['mean_e2el_ms']:.0f}", str(b["failed"]))
    return t


def _comparison_table(c: dict[str, Any]) -> Table:
    t = Table(title=f"Against {c['previous_file']} (fail beyond {c['fail_threshold_pct']:g}%)", title_justify="left")
    for col in ("benchmark", "metric", "previous", "current", "change", ""):
        t.add_column(col, justify="left" if col in ("benchmark", "metric", "") else "right")
    for x in c["deltas"]:
        change = "-" if x["change_pct"] is None else f"{x['change_pct']:+.1f}%"
        t.add_row(x["benchmark"], x["metric"], output.fmt(x["previous"]), output.fmt(x["current"]), change,
                  "[red]REGRESSED[/]" if x["regressed"] else "")
    return t


def _tables(d: dict[str, Any]) -> list[Table]:
    if "benchmarks" in d:
        tables = [_sweep_table(d)]
        for b in d["benchmarks"]:
            extra = _result_tables(b)[1:]      # failures by reason, categories, transformers
            tables += extra
    else:
        tables = _result_tables(d)
    if d.get("comparison"):
        tables.append(_comparison_table(d["comparison"]))
    return tables


def _prefix_repetition(i: int, name: str, what: str):
    """The prefix_repetition workload's flags (vLLM's names), >= 1 each."""
    return typer.Option(defaults.BENCH_PREFIX_REPETITION[i], f"--prefix-repetition-{name}", callback=in_range(1),
                        help=f"prefix_repetition: {what}, >= 1.")


@common.engine_options(exclude=("speculative_config",), before="quiet")
def bench(
    base_url: str = typer.Option(None, "--base-url", help="Server root (or ending in /v1) of an OpenAI-compatible "
                                 "server (overrides --host/--port): an online run, as --host, --port or --backend make one. "
                                 "With none of them: offline, the engine in-process."),
    host: str = typer.Option(None, "--host", help=f"The server's host (default {defaults.BENCH_HOST}): online."),
    port: int = typer.Option(None, "--port", callback=in_range(1, 65535),
                             help=f"The server's port (default {defaults.BENCH_PORT}): online."),
    backend: str = typer.Option(None, "--backend", help="openai (/v1/completions) or openai-chat "
                                "(/v1/chat/completions): online (default: --endpoint's, else openai)."),
    endpoint: str = typer.Option(None, "--endpoint", help="/v1/completions or /v1/chat/completions (default: "
                                 "--backend's)."),
    model: str = typer.Option(None, "--model", "-m", help="Offline: the model to run (folder, .gguf, HF id in the "
                              f"cache, built-in; default {defaults.DEFAULT_MODEL}). Online: the served name "
                              "(default: the server's first)."),
    tokenizer: str = typer.Option(None, "--tokenizer", help="Tokenizer for the workload (default: --model; online "
                                  "without --model: the server's model)."),
    api_key: str = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY",
                                help="Sent as `Authorization: Bearer KEY` (or OPENAI_API_KEY)."),
    dataset_name: str = typer.Option(defaults.BENCH_DATASET, "--dataset-name",
                                     help="random, sharegpt, spec_bench, prefix_repetition or prompts (a file, "
                                     "vLLM's custom)."),
    dataset_path: str = typer.Option(None, "--dataset-path", help="ShareGPT JSON, Spec-Bench jsonl (default: "
                                     "the shared copy) or a prompts file (.txt lines, .jsonl \"prompt\")."),
    num_prompts: int = typer.Option(None, "--num-prompts", callback=in_range(1),
                                    help=f"Requests per benchmark, >= 1 (default {defaults.BENCH_NUM_PROMPTS}; a "
                                    "prompts file: its prompts)."),
    duration: float = typer.Option(None, "--duration", callback=in_range(0, lo_open=True),
                                   help="Send for this many seconds instead (cycling the workload), > 0."),
    random_input_len: int = typer.Option(defaults.BENCH_RANDOM_INPUT_LEN, "--random-input-len", callback=in_range(1),
                                         help="random: prompt tokens, >= 1."),
    random_output_len: int = typer.Option(defaults.BENCH_RANDOM_OUTPUT_LEN, "--random-output-len",
                                          callback=in_range(1), help="random: output tokens (max_tokens), >= 1."),
    random_range_ratio: float = typer.Option(defaults.BENCH_RANDOM_RANGE_RATIO, "--random-range-ratio",
                                             callback=in_range(0, 1, hi_open=True),
                                             help="random: lengths uniform in [len(1-r), len(1+r)], [0, 1)."),
    random_prefix_len: int = typer.Option(defaults.BENCH_RANDOM_PREFIX_LEN, "--random-prefix-len",
                                          callback=in_range(0), help="random: tokens of a prefix shared by every "
                                          "prompt, added to the input length, >= 0."),
    sharegpt_output_len: int = typer.Option(None, "--sharegpt-output-len", callback=in_range(1),
                                            help="sharegpt: output tokens (default: the reply's length)."),
    spec_bench_output_len: int = typer.Option(defaults.BENCH_SPEC_BENCH_OUTPUT_LEN, "--spec-bench-output-len",
                                              callback=in_range(1), help="spec_bench: output tokens, >= 1."),
    spec_bench_category: str = typer.Option(None, "--spec-bench-category",
                                            help="spec_bench: only this category."),
    custom_output_len: int = typer.Option(defaults.BENCH_CUSTOM_OUTPUT_LEN, "--custom-output-len",
                                          callback=in_range(1), help="prompts: output tokens, >= 1."),
    prefix_repetition_prefix_len: int = _prefix_repetition(0, "prefix-len", "tokens of each shared prefix"),
    prefix_repetition_suffix_len: int = _prefix_repetition(1, "suffix-len", "tokens after it, each prompt's own"),
    prefix_repetition_num_prefixes: int = _prefix_repetition(2, "num-prefixes", "distinct prefixes"),
    prefix_repetition_output_len: int = _prefix_repetition(3, "output-len", "output tokens"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Generate every requested token (past EOS)."),
    seed: int = typer.Option(defaults.BENCH_SEED, "--seed", callback=in_range(SEED_MIN, SEED_MAX),
                             help="Seed of the workload and the arrival times."),
    temperature: float = typer.Option(defaults.BENCH_TEMPERATURE, "--temperature", callback=in_range(0),
                                      help="Sampling temperature, >= 0 (default 0: greedy, as vLLM's bench)."),
    top_p: float = typer.Option(None, "--top-p", callback=in_range(0, 1, lo_open=True), help="Top-p, (0, 1]."),
    top_k: int = typer.Option(None, "--top-k", callback=in_range(-1), help="Top-k, >= 1; 0 or -1 = off."),
    min_p: float = typer.Option(None, "--min-p", callback=in_range(0, 1), help="Min-p, 0 to 1."),
    request_rate: float = typer.Option(INF, "--request-rate", callback=in_range(0, lo_open=True, allow=(INF,)),
                                       help="Requests per second, > 0 (inf: all at once)."),
    burstiness: float = typer.Option(defaults.BENCH_BURSTINESS, "--burstiness",
                                     callback=in_range(0, lo_open=True, allow=(INF,)),
                                     help="Gamma shape of the arrival gaps, > 0 (1: Poisson; inf: constant)."),
    max_concurrency: int = typer.Option(None, "--max-concurrency", callback=in_range(1),
                                        help="Requests in flight at most, >= 1 (default: no cap)."),
    num_warmups: int = typer.Option(0, "--num-warmups", callback=in_range(0),
                                    help="Warm-up requests before measuring, >= 0."),
    sweep: bool = typer.Option(False, "--sweep", help="GuideLLM's sweep: synchronous, throughput, then constant "
                               "rates between the two."),
    sweep_size: int = typer.Option(defaults.BENCH_SWEEP_SIZE, "--sweep-size", callback=in_range(2),
                                   help="Benchmarks in a sweep, >= 2."),
    request_timeout: float = typer.Option(defaults.BENCH_REQUEST_TIMEOUT, "--request-timeout",
                                          callback=in_range(0, lo_open=True),
                                          help="Seconds before a request counts as failed, > 0."),
    percentile_metrics: str = typer.Option(defaults.BENCH_PERCENTILE_METRICS, "--percentile-metrics",
                                           help="Metrics with percentiles: of ttft,tpot,itl,e2el."),
    metric_percentiles: str = typer.Option(defaults.BENCH_METRIC_PERCENTILES, "--metric-percentiles",
                                           help="Percentiles, comma-separated, e.g. 50,90,99."),
    goodput: list[str] = typer.Option(None, "--goodput", help="SLO NAME:MS for goodput, ttft/tpot/e2el "
                                      "(repeatable, or 'ttft:500 tpot:50')."),
    json_out: bool = common.JsonOpt,
    output_file: str = typer.Option(None, "--output", "-o", help="Also write the JSON result to this file."),
    save_result: bool = typer.Option(False, "--save-result", help="Write vllm bench serve's result file: "
                                     "{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json."),
    save_detailed: bool = typer.Option(False, "--save-detailed", help="Keep the per-request lists in it."),
    append_result: bool = typer.Option(False, "--append-result", help="Add the result as a line to the file."),
    result_dir: str = typer.Option(None, "--result-dir", help="Its folder (created; default: here)."),
    result_filename: str = typer.Option(None, "--result-filename", help="Its name instead of the pattern."),
    label: str = typer.Option(None, "--label", help="The result's label and file prefix (default: --backend)."),
    metadata: list[str] = typer.Option(None, "--metadata", help="KEY=VALUE pairs added to the result "
                                       "(several after one flag, as vLLM)."),
    csv_file: str = typer.Option(None, "--csv", help="Write the scalar results as CSV (a row per benchmark)."),
    plot_file: str = typer.Option(None, "--plot", help="Write latency CDFs (and a sweep's curves) as a PNG "
                                  "(needs matplotlib: llmopt[plot])."),
    compare_to: str = typer.Option(None, "--compare-to", help="A previous --output JSON: print the deltas; exit "
                                   "4 if a metric regressed."),
    fail_threshold: float = typer.Option(defaults.BENCH_FAIL_THRESHOLD, "--fail-threshold", callback=in_range(0),
                                         help="Percent a metric may get worse under --compare-to, >= 0."),
    compare_metrics: str = typer.Option(None, "--compare-metrics", help="The metrics --compare-to checks, "
                                        "comma-separated (e.g. output_throughput,mean_tpot_ms; default: all)."),
    compare: str = typer.Option(None, "--compare", help="hf: also run transformers generate on the same prompts "
                                "(offline)."),
    spec: str = typer.Option("none", "--spec", help="Offline speculative decoding: none, ngram, draft_model, eagle "
                             "or eagle3; the same prompts also run without it and the speedup is reported."),
    spec_model: str = typer.Option(None, "--spec-model", help="Draft model or EAGLE head folder of --spec."),
    num_speculative_tokens: int = typer.Option(None, "--num-speculative-tokens", callback=in_range(1),
                                               help=f"Draft tokens per step of --spec (default "
                                               f"{defaults.BENCH_SPEC_NUM_TOKENS})."),
    speculative_config: str = typer.Option(None, "--speculative-config",
                                           help="vLLM's JSON or a spec_config.json from llmopt spec-tune "
                                           "(instead of --spec ...)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", "--disable-tqdm", help="No progress bar (or vLLM's "
                               "--disable-tqdm)."),
    **engine: Any,
) -> None:
    """Benchmark a server (online) or the engine (offline) with vLLM's metrics."""
    # deferred: keep CLI start-up fast
    from llmopt.bench.config import BenchConfig, SamplingSpec, resolve_backend, server_url
    from llmopt.bench.datasets import Workload
    from llmopt.bench.metrics import parse_goodput, parse_metric_names, parse_percentiles
    from llmopt.bench.saved import parse_metadata
    from llmopt.bench.schedule import Load
    from llmopt.speculative.config import bench_speculative_config

    spec_config = bench_speculative_config(spec, spec_model, num_speculative_tokens, speculative_config)
    spec = spec_config.method if spec_config is not None else "none"
    endpoint, meta = resolve_backend(backend, endpoint), parse_metadata(metadata)
    if any(x is not None for x in (base_url, host, port, backend)):   # online: vLLM's server, over --host/--port
        if base_url is not None and (host is not None or port is not None):
            output.err.print("[yellow]warning:[/] --host/--port left unused: --base-url names the server (as "
                             "vllm bench serve)", highlight=False)
        base_url = server_url(base_url, host, port)
    save = _save_spec(save_result or append_result, save_detailed, append_result, result_dir, result_filename,
                      sweep, [compare_to, dataset_path])
    previous, only = _check_flags(compare, base_url, engine, {"--output": output_file, "--csv": csv_file,
                                                               "--plot": plot_file}, [compare_to, dataset_path],
                                  compare_to, compare_metrics)
    engine_args = None
    if base_url is None:
        from llmopt.engine.args import EngineArgs
        engine_args = EngineArgs(**common.engine_args_from_flags(engine, model=model, seed=seed,
                                                                 speculative_config=spec_config))
    cfg = BenchConfig(
        workload=Workload(dataset_name, dataset_path, num_prompts, seed, random_input_len, random_output_len,
                              random_range_ratio, random_prefix_len, sharegpt_output_len, spec_bench_output_len,
                              spec_bench_category, custom_output_len,
                              (prefix_repetition_prefix_len, prefix_repetition_suffix_len,
                               prefix_repetition_num_prefixes, prefix_repetition_output_len)),
        load=Load(request_rate, burstiness, max_concurrency, duration, seed),
        sampling=SamplingSpec(temperature, top_p, top_k, min_p, ignore_eos),
        base_url=base_url, endpoint=endpoint, model=model, tokenizer=tokenizer, api_key=api_key,
        num_warmups=num_warmups, percentiles=parse_percentiles(metric_percentiles),
        percentile_metrics=parse_metric_names(percentile_metrics), goodput=parse_goodput(goodput),
        request_timeout=request_timeout, engine_args=engine_args, compare_hf=compare == "hf", sweep=sweep,
        sweep_size=sweep_size, spec=spec, label=label, metadata=meta)
    report = _run(cfg, quiet)
    _report(report, previous, only, compare_to, fail_threshold, json_out, output_file, csv_file, plot_file, save)


def _save_spec(save: bool, detailed: bool, append: bool, result_dir: str | None, result_filename: str | None,
               sweep: bool, inputs: list):
    """vllm bench serve's --save-result (or --append-result) as a SaveSpec, its folder made and its
    file checked before the run; None without it (its other flags then warn: they write nothing)."""
    # deferred: keep CLI start-up fast
    from pathlib import Path

    from llmopt.bench.saved import SaveSpec
    from llmopt.fsutil import check_output_file

    if not save:
        unused = [f for f, v in (("--save-detailed", detailed), ("--result-dir", result_dir),
                                 ("--result-filename", result_filename)) if v]
        if unused:
            output.err.print(f"[yellow]warning:[/] {', '.join(unused)} without --save-result: no result file is "
                             "written (as vllm bench serve)", highlight=False)
        return None
    if sweep:
        raise UserInputError("--save-result writes one run's result (vllm bench serve's file): a --sweep's "
                             "results go to --output")
    if result_dir:
        Path(result_dir).mkdir(parents=True, exist_ok=True)   # as vLLM: the folder is made
    spec = SaveSpec(result_dir, result_filename, detailed, append)
    if result_filename:
        name = Path(result_dir) / result_filename if result_dir else Path(result_filename)
        check_output_file(name, inputs, flag="--result-filename")
    return spec


def _check_flags(compare: str | None, base_url: str | None, engine: dict, outputs: dict[str, str | None],
                 inputs: list, compare_to: str | None, compare_metrics: str | None):
    """Reject flag combinations that cannot work, before anything loads; returns the --compare-to result
    (or None) and the metrics it compares (None: all)."""
    # deferred: keep CLI start-up fast
    from llmopt.bench.report import check_matplotlib, comparable_metrics, load_previous
    from llmopt.fsutil import check_output_file

    if compare not in (None, "hf"):
        raise UserInputError(f"--compare {compare}: the one comparison is hf (transformers generate)")
    if base_url is not None:
        given = common.engine_flags_given(engine)
        if given:
            flags = ", ".join(given)
            raise UserInputError(f"{flags}: engine flags are for offline runs; a server (--base-url, --host, "
                                 "--port, --backend) runs on its own settings")
    for flag, path in outputs.items():
        if path:
            check_output_file(path, inputs, flag=flag)
    if outputs["--plot"]:
        check_matplotlib()
    previous = load_previous(compare_to) if compare_to else None
    only = comparable_metrics(compare_metrics)
    if only is not None and compare_to is None:
        raise UserInputError("--compare-metrics needs --compare-to")
    return previous, only


def _run(cfg, quiet: bool):
    """Run the benchmark with progress bars; the first Ctrl-C stops sending and reports what completed."""
    # deferred: keep CLI start-up fast
    from llmopt.bench.config import Hooks
    from llmopt.bench.runner import run_benchmark
    from llmopt.cli.generate import log_to_stderr

    log_to_stderr(logging.WARNING if quiet else logging.INFO)
    stop = threading.Event()

    def on_sigint(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        output.err.print("stopping: no new requests; reporting what completed (Ctrl-C again to abort)",
                         highlight=False)

    in_main = threading.current_thread() is threading.main_thread()
    previous_handler = signal.signal(signal.SIGINT, on_sigint) if in_main else None
    try:
        with _Bars(enabled=not quiet) as bars:
            return run_benchmark(cfg, Hooks(bars.start, bars.advance, stop))
    finally:
        if in_main:
            signal.signal(signal.SIGINT, previous_handler)


def _report(report, previous, only, compare_to: str | None, fail_threshold: float, json_out: bool,
            output_file: str | None, csv_file: str | None, plot_file: str | None, save=None) -> None:
    """Print and write the report (with the --compare-to comparison, and --save-result's file); exit 130
    when interrupted, 4 when a metric regressed."""
    # deferred: keep CLI start-up fast
    import json

    from llmopt.bench.report import EXIT_REGRESSION, compare as compare_results, plot, to_csv
    from llmopt.fsutil import write_atomic

    result = report.to_dict()
    if previous is not None and not report.interrupted:
        report.comparison = compare_results(previous, result, fail_threshold, compare_to, only)
        result = report.to_dict()
    output.emit(result, as_json=json_out, table=_tables, output=output_file)
    if csv_file:
        write_atomic(csv_file, to_csv(result))
    if plot_file:
        plot(report, plot_file)
    if save is not None:   # one line of JSON, as vLLM's json.dump; --append-result: after the file's lines
        path = save.path(report.results[0])
        text = json.dumps(output.to_jsonable(save.content(result)))
        if save.append and path.is_file() and path.stat().st_size:
            text = path.read_text(encoding="utf-8") + "\n" + text
        write_atomic(path, text)
    if report.interrupted:
        done = sum(r.summary.completed for r in report.results)
        output.fail(f"interrupted: reported the {done} request(s) that completed", 130)
    if report.comparison is not None and report.comparison.regressions:
        worst = ", ".join(f"{d.metric} {'-' if d.change_pct is None else f'{d.change_pct:+.1f}%'}"
                          for d in report.comparison.regressions[:5])
        n = len(report.comparison.regressions)
        output.fail(f"{n} metric(s) regressed beyond {fail_threshold:g}% against {compare_to}: {worst}",
                    EXIT_REGRESSION)
