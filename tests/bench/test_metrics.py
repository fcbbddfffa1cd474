"""vLLM's metric definitions on hand-made records, goodput, flag parsing, and the server's
Prometheus counters differenced over a run."""

from __future__ import annotations

import numpy as np
import pytest

from llmopt.bench.metrics import (RequestRecord, parse_goodput, parse_metric_names, parse_percentiles,
                                  parse_prometheus, percentile_key, server_stats, summarize)
from llmopt.errors import UserInputError


def rec(ttft, itl, start=0.0, prompt_len=10, out=None, **kw):
    return RequestRecord(prompt_len, 8, success=True, start_time=start, ttft=ttft, itl=list(itl),
                         latency=ttft + sum(itl), output_tokens=len(itl) + 1 if out is None else out, **kw)


def test_definitions_follow_vllm():
    records = [rec(0.1, [0.02, 0.04], start=0.0), rec(0.3, [0.05] * 4, start=0.5, prompt_len=20),
               RequestRecord(5, 8, error="HTTP 500: boom"), rec(0.2, [], start=0.1, out=1)]
    s = summarize(records, duration=2.0, percentiles=[50, 99])
    assert (s.completed, s.failed, s.cancelled) == (3, 1, 0)
    assert s.total_input_tokens == 10 + 20 + 10 and s.total_output_tokens == 3 + 5 + 1
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(9 / 2) and s.total_token_throughput == pytest.approx(49 / 2)
    # TPOT excludes the first token and one-token requests
    tpots = [(0.16 - 0.1) / 2 * 1000, (0.5 - 0.3) / 4 * 1000]
    assert s.stats["tpot"].mean == pytest.approx(np.mean(tpots))
    itls = [20, 40, 50, 50, 50, 50]
    assert s.stats["itl"].mean == pytest.approx(np.mean(itls)) and s.stats["itl"].median == pytest.approx(50)
    assert s.stats["itl"].percentiles[99] == pytest.approx(np.percentile(itls, 99))
    assert s.stats["ttft"].std == pytest.approx(np.std([100, 300, 200]))
    assert s.stats["e2el"].mean == pytest.approx(np.mean([160, 500, 200]))
    assert s.output_lens == [3, 5, 0, 1]
    assert s.failed_reasons == {"HTTP 500: boom": 1}
    assert s.max_concurrent_requests == 2          # [0, .16), [.5, 1), [.1, .3): two overlap
    assert s.request_goodput is None


def test_peak_concurrency_and_tokens_per_second():
    records = [rec(0.05, [0.1] * 9, start=0.0), rec(0.05, [0.1] * 9, start=0.02), rec(0.1, [0.1], start=2.0)]
    s = summarize(records, duration=3.0)
    assert s.max_concurrent_requests == 2
    assert s.max_output_tokens_per_s == 20          # both long requests put 10 tokens each in second 0


def test_goodput_counts_requests_meeting_every_slo():
    records = [rec(0.1, [0.02, 0.02]), rec(0.5, [0.02, 0.02]), rec(0.1, [0.2, 0.2]), rec(0.1, [], out=1)]
    s = summarize(records, duration=1.0, goodput={"ttft": 200})
    assert s.request_goodput == pytest.approx(3)
    s = summarize(records, duration=1.0, goodput={"ttft": 200, "tpot": 50})
    assert s.request_goodput == pytest.approx(2)    # a one-token request's TPOT is 0, as vLLM
    s = summarize(records, duration=2.0, goodput={"e2el": 150})
    assert s.request_goodput == pytest.approx(1.0)   # E2ELs .14, .54, .5, .1: two within 150 ms, over 2 s


def test_output_tokens_fall_back_to_the_tokenizer():
    class Tok:
        def __call__(self, text, add_special_tokens=True):
            return type("E", (), {"input_ids": text.split()})()
    r = rec(0.1, [0.1, 0.1], out=None)
    r.output_tokens, r.generated_text = None, "a b c d"
    assert summarize([r], 1.0, Tok()).total_output_tokens == 4


def test_flag_parsing():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["ttft:500 e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(UserInputError):
            parse_goodput(bad)
    assert parse_percentiles("50,90,99.9") == [50, 90, 99.9]
    assert percentile_key(99.9, "ttft") == "p99.9_ttft_ms" and percentile_key(99.0, "itl") == "p99_itl_ms"
    for bad in ("", "101", "a"):
        with pytest.raises(UserInputError):
            parse_percentiles(bad)
    assert parse_metric_names("ttft,e2el") == ["ttft", "e2el"]
    with pytest.raises(UserInputError):
        parse_metric_names("ttft,bogus")


PROM = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {q}
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {h}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {d}
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {dt}
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {a}
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {p0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {p1}
"""


def test_server_counters_are_differenced_and_the_gauge_averaged():
    before = parse_prometheus(PROM.format(q=100, h=10, kv=0.1, d=5, dt=10, a=4, p0=3, p1=1))
    after = parse_prometheus(PROM.format(q=300, h=110, kv=0.5, d=25, dt=50, a=34, p0=18, p1=10))
    assert after.kv_usage == pytest.approx(0.5)
    st = server_stats(before, after, [0.2, 0.6, 0.4])
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (200, 100)
    assert st.prefix_cache_hit_rate == pytest.approx(0.5)
    assert st.kv_cache_usage_mean == pytest.approx(0.4) and st.kv_cache_usage_max == pytest.approx(0.6)
    assert st.spec_decode_acceptance_rate == pytest.approx(100 * 30 / 40)
    assert st.spec_decode_acceptance_length == pytest.approx(1 + 30 / 20)
    assert st.spec_decode_per_position_acceptance_rates == pytest.approx([15 / 20, 9 / 20])
    none = server_stats(None, None, [])
    assert none.prefix_cache_hit_rate is None and none.kv_cache_usage_mean is None
