"""Offline (the engine in-process) against online (`llmopt serve` on the same engine settings) on one
workload with --ignore-eos: the same output token counts, request by request; the engine's
per-token timestamps behind offline TTFT/ITL; --compare hf on the same prompts."""

from __future__ import annotations

import pytest

from bench_util import SERVE_ARGS, start_llmopt_serve
from conftest import make_tiny
from llmopt.bench.config import BenchConfig, SamplingSpec
from llmopt.bench.datasets import Workload, count_tokens
from llmopt.bench.runner import run_benchmark
from llmopt.bench.schedule import Load
from llmopt.engine.args import EngineArgs

# the engine settings of SERVE_ARGS, for the offline side
ENGINE = dict(max_model_len=256, kv_cache_memory=16 << 20, block_size=16, max_num_seqs=32)
assert SERVE_ARGS == ["--max-model-len", "256", "--kv-cache-memory-bytes", "16MiB", "--block-size", "16",
                      "--max-num-seqs", "32"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("bench-tiny"), tokenizer=True)


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    gen = start_llmopt_serve(tiny, tmp_path_factory.mktemp("bench-serve") / "server.log")
    yield next(gen)
    gen.close()


def workload() -> Workload:
    return Workload("random", num_prompts=10, random_input_len=24, random_output_len=12, random_range_ratio=0.5,
                        random_prefix_len=32, seed=5)


def test_offline_and_online_agree_on_output_token_counts(tiny, served):
    load = Load(max_concurrency=4)
    sampling = SamplingSpec(ignore_eos=True)
    online = run_benchmark(BenchConfig(workload=workload(), load=load, sampling=sampling, base_url=served,
                                       tokenizer=str(tiny))).to_dict()
    offline_report = run_benchmark(BenchConfig(workload=workload(), load=load, sampling=sampling,
                                               engine_args=EngineArgs(model=str(tiny), **ENGINE)))
    offline = offline_report.to_dict()
    assert online["mode"] == "online" and offline["mode"] == "offline"
    assert online["completed"] == offline["completed"] == 10 and online["failed"] == offline["failed"] == 0
    assert online["output_lens"] == offline["output_lens"]                      # exactly, request by request
    assert online["input_lens"] == offline["input_lens"]
    assert sum(offline["output_lens"]) == offline["total_output_tokens"] == online["total_output_tokens"]
    assert len(set(offline["output_lens"])) > 1                                  # lengths drawn over a range
    # the prompts are exactly their drawn lengths for this tokenizer (the server counted the same)
    from llmopt.bench.datasets import load_tokenizer, sample_requests
    tok = load_tokenizer(str(tiny))
    reqs = sample_requests(workload(), tok)
    assert [r.prompt_len for r in reqs] == offline["input_lens"] == [count_tokens(tok, r.prompt) for r in reqs]
    assert [r.expected_output_len for r in reqs] == offline["output_lens"]
    # offline ITL comes from the engine's per-token timestamps: one gap per token after the first
    res = offline_report.results[0]
    assert [len(r.itl) for r in res.records] == [n - 1 for n in offline["output_lens"]]
    assert all(r.ttft > 0 and r.latency >= r.ttft + sum(r.itl) - 1e-6 for r in res.records)
    assert max(offline["start_times"]) > 0 and offline["max_concurrent_requests"] <= 4
    # the shared prefix shows up in both prefix-cache views (the server's /metrics, the engine's stats)
    assert online["prefix_cache_hit_rate"] > 0 and offline["prefix_cache_hit_rate"] > 0
    assert offline["kv_cache_usage_max"] is not None and online["kv_cache_usage_max"] is not None


def test_engine_records_a_time_for_every_output_token(tiny):
    from llmopt import LLM, SamplingParams
    llm = LLM(str(tiny), **ENGINE)
    outs = llm.generate(["a b c", "hello there"], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))
    for out in outs:
        m = out.metrics
        assert len(m.token_times) == len(out.outputs[0].token_ids) == 6
        assert m.token_times == sorted(m.token_times) and m.token_times[0] == m.first_token_time
        assert m.arrival_time <= m.token_times[0] and m.token_times[-1] <= m.finished_time


def test_compare_hf_generates_the_same_number_of_tokens(tiny):
    cfg = BenchConfig(workload=Workload("random", num_prompts=4, random_input_len=16, random_output_len=8),
                      load=Load(max_concurrency=2), sampling=SamplingSpec(ignore_eos=True),
                      engine_args=EngineArgs(model=str(tiny), **ENGINE), compare_hf=True)
    d = run_benchmark(cfg).to_dict()
    hf = d["compare_hf"]
    assert hf["batch_size"] == 2 and hf["total_output_tokens"] == d["total_output_tokens"] == 32
    assert hf["total_input_tokens"] == d["total_input_tokens"] == 64
    assert hf["speedup_output_throughput"] == pytest.approx(d["output_throughput"] / hf["output_throughput"])


def test_offline_follows_the_schedule_and_stops_on_the_stop_event(tiny):
    import threading

    from llmopt.bench.config import Hooks
    from llmopt.bench.offline import build_engine, run_engine
    from llmopt.bench.schedule import plan
    cfg = BenchConfig(workload=Workload("random", num_prompts=8, random_input_len=16, random_output_len=4),
                      load=Load(request_rate=4.0, seed=3), engine_args=EngineArgs(model=str(tiny), **ENGINE))
    engine = build_engine(cfg)
    from llmopt.bench.datasets import sample_requests
    reqs = sample_requests(cfg.workload, engine.tokenizer)
    out = run_engine(engine, cfg, reqs, cfg.load)
    want = plan(8, 4.0, 1.0, 3).offsets                    # over 2 s
    sent = [r.start_time for r in out.records]
    # a request joins at the first step boundary after it is due (a step of the tiny model: well under 0.3 s)
    assert all(0 <= s - w < 0.3 for s, w in zip(sent, want)), list(zip(sent, want))
    assert [r.scheduled_time for r in out.records] == want.tolist()
    assert all(r.success for r in out.records) and not out.interrupted
    stop, done = threading.Event(), []

    def advance(n):
        done.append(n)
        if len(done) == 2:
            stop.set()
    out = run_engine(engine, cfg, reqs, cfg.load, Hooks(advance=advance, stop=stop))
    assert out.interrupted and sum(r.success for r in out.records) == 2 and len(out.records) < 8
    assert not engine.has_unfinished_requests()            # what was running was aborted
