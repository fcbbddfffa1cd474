"""`llmopt bench` on the command line against the scripted server: the JSON keys (a schema that must
not drift), --output / --csv / --plot files, a sweep, --compare-to exit codes (0, 4 on a regression,
2 on a bad file), and refusals (--spec, engine flags online, --plot without matplotlib)."""

from __future__ import annotations

import csv
import json
import sys

import pytest
from typer.testing import CliRunner

from bench_util import ScriptedServerProcess
from llmopt.bench.report import EXIT_REGRESSION, compare
from llmopt.cli.app import app

# The keys of one run's JSON with the default --percentile-metrics and --metric-percentiles.
SCHEMA = [
    "date", "endpoint_type", "backend", "label", "mode", "strategy", "endpoint", "base_url", "model_id", "tokenizer_id",
    "dataset_name", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration_limit", "duration", "interrupted",
    "completed", "failed", "cancelled", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests", "rtfx",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms",
    "goodput_config", "failed_reasons",
    "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate", "num_preemptions",
    "kv_offload_hit_tokens", "kv_cache_usage_mean", "kv_cache_usage_max", "spec_decode_num_drafts", "spec_decode_draft_tokens",
    "spec_decode_accepted_tokens", "spec_decode_acceptance_rate", "spec_decode_acceptance_length",
    "spec_decode_per_position_acceptance_rates", "server_mean_tpot_ms", "per_category", "compare_hf", "compare_spec",
    "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times", "generated_texts", "errors",
    "comparison",
]


@pytest.fixture(scope="module")
def server():
    with ScriptedServerProcess(ttft=0.1, gaps=(0.05,)) as s:
        yield s


def run(server, *args: str):
    base = ["bench", "--base-url", server.url + "/v1", "--tokenizer", "smollm2-135m", "--num-prompts", "4",
            "--random-input-len", "16", "--random-output-len", "3", "-q"]
    return CliRunner().invoke(app, base + list(args), env={"COLUMNS": "200"})


def test_json_keys_files_and_a_passing_comparison(server, tmp_path):
    out, csv_file, png = tmp_path / "a.json", tmp_path / "a.csv", tmp_path / "a.png"
    res = run(server, "--json", "-o", str(out), "--csv", str(csv_file), "--plot", str(png), "--goodput", "ttft:5000",
              "--metric-percentiles", "50,99")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    want = SCHEMA[:SCHEMA.index("mean_ttft_ms")] + [
        k for m in ("ttft", "tpot", "itl", "e2el") for k in
        [f"mean_{m}_ms", f"median_{m}_ms", f"std_{m}_ms"] + ([f"p50_{m}_ms", f"p99_{m}_ms"] if m != "e2el" else [])
    ] + SCHEMA[SCHEMA.index("goodput_config"):]
    assert list(d) == want
    assert d["completed"] == 4 and d["request_goodput"] == pytest.approx(d["request_throughput"])
    assert d["base_url"].endswith("/v1") and d["model_id"] == "scripted" and d["comparison"] is None
    assert json.loads(out.read_text()) == d
    with open(csv_file, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and int(rows[0]["completed"]) == 4
    assert float(rows[0]["output_throughput"]) == pytest.approx(d["output_throughput"])
    assert "ttfts" not in rows[0] and rows[0]["model_id"] == "scripted"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the same workload again, against the first result with a generous threshold: exit 0
    res = run(server, "--json", "--compare-to", str(out), "--fail-threshold", "400")
    assert res.exit_code == 0, res.output
    c = json.loads(res.stdout)["comparison"]
    assert c["fail_threshold_pct"] == 400 and not any(x["regressed"] for x in c["deltas"])
    assert {"request_throughput", "mean_ttft_ms", "p99_itl_ms", "failed"} <= {x["metric"] for x in c["deltas"]}


def test_default_schema_and_a_regression_exits_4(server, tmp_path):
    res = run(server, "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert list(d) == SCHEMA
    better = dict(d, output_throughput=d["output_throughput"] * 2, mean_ttft_ms=d["mean_ttft_ms"] / 2)
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps(better))
    res = run(server, "--compare-to", str(prev))
    assert res.exit_code == EXIT_REGRESSION == 4, res.output
    assert "REGRESSED" in res.stdout and "regressed beyond 10%" in res.stderr
    assert "output_throughput" in res.stderr and "mean_ttft_ms" in res.stderr
    # --compare-metrics: only the named metrics are gated (TTFT halved is left out here, throughput is not)
    res = run(server, "--json", "--compare-to", str(prev), "--compare-metrics", "mean_tpot_ms,output_throughput")
    assert res.exit_code == 4 and {x["metric"] for x in json.loads(res.stdout)["comparison"]["deltas"]} == \
        {"mean_tpot_ms", "output_throughput", "failed"}
    res = run(server, "--compare-to", str(prev), "--compare-metrics", "mean_ttft_ms", "--fail-threshold", "1000")
    assert res.exit_code == 0, res.output
    res = run(server, "--compare-to", str(prev), "--compare-metrics", "tokens_per_joule")
    assert res.exit_code == 2 and "--compare-metrics" in res.stderr
    res = run(server, "--compare-metrics", "mean_tpot_ms")
    assert res.exit_code == 2 and "needs --compare-to" in res.stderr


def test_compare_logic_directions_and_thresholds():
    prev = {"request_throughput": 10.0, "mean_ttft_ms": 100.0, "p99_itl_ms": 50.0, "failed": 0,
            "request_goodput": None, "std_ttft_ms": 1.0}
    cur = {"request_throughput": 9.5, "mean_ttft_ms": 104.0, "p99_itl_ms": 70.0, "failed": 0,
           "request_goodput": 3.0, "std_ttft_ms": 9.0}
    comp = compare(prev, cur, 10.0, "prev.json")
    by = {x.metric: x for x in comp.deltas}
    assert set(by) == {"request_throughput", "mean_ttft_ms", "p99_itl_ms", "failed"}   # std and None: not gated
    assert not by["request_throughput"].regressed and by["request_throughput"].change_pct == pytest.approx(-5)
    assert not by["mean_ttft_ms"].regressed and by["p99_itl_ms"].regressed
    assert [x.metric for x in compare(prev, dict(cur, failed=1), 50.0, "p").regressions] == ["failed"]
    assert compare(prev, dict(cur, request_throughput=8.0), 10.0, "p").regressions[0].metric == "request_throughput"


def test_a_sweep_runs_synchronous_throughput_and_constant_rates(server, tmp_path):
    png = tmp_path / "sweep.png"
    res = run(server, "--sweep", "--sweep-size", "3", "--json", "--plot", str(png))
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    strategies = [b["strategy"] for b in d["benchmarks"]]
    assert strategies[:2] == ["synchronous", "throughput"] and strategies[2].startswith("constant@")
    sync, thr, const = d["benchmarks"]
    assert sync["max_concurrent_requests"] == 1 and thr["max_concurrent_requests"] == 4
    assert thr["request_throughput"] > 2 * sync["request_throughput"]
    assert const["request_rate"] == pytest.approx(thr["request_throughput"])      # linspace(sync, thr, 2)[1:]
    assert all(b["completed"] == 4 for b in d["benchmarks"]) and png.stat().st_size > 1000
    res = run(server, "--compare-to", str(tmp_path / "missing.json"))
    assert res.exit_code == 2 and "no such file" in res.stderr
    single = tmp_path / "single.json"
    single.write_text(json.dumps(d["benchmarks"][0]))
    res = run(server, "--sweep", "--sweep-size", "3", "--compare-to", str(single))
    assert res.exit_code == 2 and "compare like with like" in res.stderr


@pytest.mark.parametrize("args, fragment", [
    (["--spec", "ngram"], "configures the offline engine"),
    (["--spec-model", "x"], "need --spec METHOD"),
    (["--max-num-seqs", "4"], "engine flags are for offline runs"),
    (["--endpoint", "/v1/embeddings"], "--endpoint"),
    (["--goodput", "itl:5"], "SLO names"),
    (["--compare", "vllm"], "--compare vllm"),
    (["--request-rate", "0"], "out of range"),
    (["--sweep", "--duration", "5", "--request-rate", "2"], "--sweep with --duration"),
])
def test_refusals_are_one_line_exit_2(server, args, fragment):
    res = run(server, *args)
    assert res.exit_code == 2 and fragment in res.stderr, res.output
    assert len(res.stderr.strip().splitlines()) == 1


def test_plot_without_matplotlib_says_how_to_get_it(server, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    res = run(server, "--plot", str(tmp_path / "x.png"))
    assert res.exit_code == 2 and "pip install 'llmopt[plot]'" in res.stderr
    assert not (tmp_path / "x.png").exists()


def test_spec_bench_gets_a_table_per_category(server):
    res = run(server, "--dataset-name", "spec_bench", "--num-prompts", "8", "--spec-bench-output-len", "2", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    cats = d["per_category"]
    assert sum(c["completed"] for c in cats.values()) == 8 and len(cats) >= 2
    assert all(c["total_output_tokens"] == 2 * c["completed"] and c["mean_tokens_per_s"] > 0 for c in cats.values())
    res = run(server, "--dataset-name", "spec_bench", "--num-prompts", "4", "--spec-bench-output-len", "2")
    assert res.exit_code == 0 and "Per category" in res.stdout and "Serving Benchmark Result" in res.stdout
