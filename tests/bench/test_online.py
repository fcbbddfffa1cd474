"""The online client against a scripted server that records its own timestamps: the client's TTFT,
TPOT, ITL, E2EL and throughput agree with the server's record; requests go out on the schedule;
--max-concurrency holds on the server's side; failures and timeouts are counted with their reasons;
Ctrl-C (the stop event) reports what completed."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from scipy import stats

from bench_util import ScriptedServerProcess
from llmopt.bench.config import BenchConfig, Hooks
from llmopt.bench.datasets import Workload
from llmopt.bench.runner import run_benchmark
from llmopt.bench.schedule import Load, plan
from llmopt.errors import LLMOptError

TOKENIZER = "smollm2-135m"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def server():
    with ScriptedServerProcess(ttft=0.25, gaps=(0.05, 0.07)) as s:
        yield s


def bench(server, **kw):
    workload = kw.pop("workload", None) or Workload("random", num_prompts=kw.pop("n", 12), random_input_len=16,
                                                        random_output_len=kw.pop("out", 8), seed=kw.pop("seed", 0))
    load = Load(**kw.pop("load", {}))
    hooks = kw.pop("hooks", None)
    server.reset()
    return run_benchmark(BenchConfig(workload=workload, load=load, base_url=server.url, tokenizer=TOKENIZER, **kw),
                         hooks)


def close(client_ms: float, server_s: float) -> bool:
    """Within 5% or 3 ms of the server's value, whichever is larger."""
    return abs(client_ms - server_s * 1000) <= max(0.05 * server_s * 1000, 3.0)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_client_metrics_match_the_servers_record(server, endpoint):
    report = bench(server, endpoint=endpoint, load=dict(request_rate=8.0, max_concurrency=4, seed=1),
                   kv_sample_interval=0.2)
    d = report.to_dict()
    recs, max_active = server.state()
    assert d["completed"] == 12 and d["failed"] == 0 and len(recs) == 12
    assert d["total_output_tokens"] == 12 * 8 == sum(len(r.token_times) for r in recs)
    values = {"ttft": [r.ttft for r in recs], "tpot": [r.tpot for r in recs],
              "itl": [g for r in recs for g in r.itl], "e2el": [r.e2el for r in recs]}
    for m, xs in values.items():
        assert close(d[f"mean_{m}_ms"], statistics.mean(xs)), (m, d[f"mean_{m}_ms"], statistics.mean(xs))
        assert close(d[f"median_{m}_ms"], statistics.median(xs)), (m, d[f"median_{m}_ms"], statistics.median(xs))
    # the scripted gaps are what the client saw between tokens
    assert statistics.median(values["itl"]) == pytest.approx(0.06, abs=0.012)
    span = max(r.token_times[-1] for r in recs) - min(r.received for r in recs)
    assert d["output_throughput"] == pytest.approx(96 / span, rel=0.05)
    assert d["request_throughput"] == pytest.approx(12 / span, rel=0.05)
    assert max_active <= 4 and d["max_concurrent_requests"] <= 4
    # the server's /metrics: counters differenced, the KV gauge sampled while it ran
    words = [len(r.prompt.split()) for r in recs]
    assert d["prefix_cache_queries"] == sum(words) and d["prefix_cache_hits"] == sum(w // 2 for w in words)
    assert d["prefix_cache_hit_rate"] == pytest.approx(sum(w // 2 for w in words) / sum(words))
    assert 0 < d["kv_cache_usage_max"] <= 0.4 and 0 <= d["kv_cache_usage_mean"] <= d["kv_cache_usage_max"]


def test_send_times_follow_the_poisson_schedule(server):
    rate, n, seed = 20.0, 30, 7
    report = bench(server, n=n, out=1, load=dict(request_rate=rate, seed=seed))
    res = report.results[0]
    recs, _ = server.state()
    want = plan(n, rate, 1.0, seed).offsets
    scheduled = np.array([r.scheduled_time for r in res.records])
    assert np.allclose(scheduled, want)
    gaps = np.diff(np.concatenate([[0.0], scheduled]))
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.01
    sent = np.array([r.start_time for r in res.records])
    assert np.all(sent - scheduled >= -1e-3) and np.all(sent - scheduled < 0.015), (sent - scheduled).max()
    received = np.array(sorted(r.received for r in recs))
    assert np.abs((received - received[0]) - (scheduled - scheduled[0])).max() < 0.025
    assert report.to_dict()["request_rate"] == rate


def test_max_concurrency_is_never_exceeded_on_the_server(server):
    report = bench(server, n=14, out=2, load=dict(max_concurrency=3))
    _, max_active = server.state()
    d = report.to_dict()
    assert d["completed"] == 14 and max_active == 3 and d["max_concurrent_requests"] == 3
    waits = [r.queue_time for r in report.results[0].records]
    assert max(waits) > 0.5          # the later requests waited for a slot, all due at once


def test_failures_and_timeouts_are_counted_not_raised(server, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("ok one\nfail500 now\nhang forever\nmidstream please\ndrop it\nok two\n")
    report = bench(server, workload=Workload("prompts", str(prompts), custom_output_len=4),
                   request_timeout=1.0)
    d = report.to_dict()
    assert d["completed"] == 2 and d["failed"] == 4 and d["cancelled"] == 0
    assert d["failed_reasons"] == {"HTTP 500: scripted failure": 1, "timeout after 1 s": 1,
                                   "error in the stream: scripted stream error": 1,
                                   "the stream ended before its last chunk": 1}
    assert d["output_lens"] == [4, 0, 0, 0, 0, 4] and d["total_output_tokens"] == 8
    assert [bool(e) for e in d["errors"]] == [False, True, True, True, True, False]


def test_an_unreachable_server_is_one_clear_error(tmp_path):
    from bench_util import free_port
    with pytest.raises(LLMOptError, match="cannot reach the server"):
        run_benchmark(BenchConfig(base_url=f"http://127.0.0.1:{free_port()}/v1", tokenizer=TOKENIZER))


def test_stop_event_ends_sending_and_reports_what_completed(server):
    stop = threading.Event()
    done = []

    def advance(n: int) -> None:          # Ctrl-C after the fourth completion
        done.append(n)
        if len(done) == 4:
            stop.set()
    report = bench(server, n=40, out=2, load=dict(request_rate=10.0), hooks=Hooks(advance=advance, stop=stop))
    d = report.to_dict()
    assert report.interrupted and d["interrupted"]
    assert 4 <= d["completed"] <= 6 and d["failed"] == 0 and d["completed"] + d["cancelled"] == d["num_prompts"] < 40
    assert d["cancelled"] >= 1 and d["duration"] < 2.0      # 40 at 10/s would take 4 s


def test_ctrl_c_on_the_command_line_prints_the_partial_result_and_exits_130(server):
    server.reset()
    cmd = [sys.executable, "-m", "llmopt", "bench", "--base-url", server.url, "--tokenizer", TOKENIZER,
           "--num-prompts", "60", "--random-input-len", "16", "--random-output-len", "2", "--request-rate", "10",
           "--json", "-q"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO})
    deadline = time.monotonic() + 60
    while sum(len(r.token_times) == 2 for r in server.state()[0]) < 2:     # two answered in full
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "slow"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    d = json.loads(out)
    assert d["interrupted"] and d["completed"] + d["cancelled"] < 60 and d["completed"] >= 1
    assert "interrupted: reported the" in err.decode()
    assert httpx.get(server.url + "/_records").status_code == 200     # the server is fine


def test_duration_sends_for_that_long_and_waits_for_what_is_in_flight(server):
    report = bench(server, n=3, out=2, load=dict(request_rate=10.0, duration=1.2, seed=2))
    d = report.to_dict()
    recs, _ = server.state()
    assert 6 <= d["num_prompts"] <= 20 and d["num_prompts"] == len(recs)         # ~ 10/s x 1.2 s, cycling 3 prompts
    assert max(d["start_times"]) < 1.2 + 0.02 and d["completed"] == d["num_prompts"]
    assert d["duration"] > max(d["start_times"]) + 0.25 and d["duration_limit"] == 1.2
