"""bench --spec offline: the same prompts with and without speculation in one run; the report has
the speedup, the acceptance length (1 + accepted / drafts) and the rate per position, and greedy
outputs are identical."""

import pytest

from llmopt.bench.config import BenchConfig, SamplingSpec
from llmopt.bench.datasets import Workload
from llmopt.bench.runner import run_benchmark
from llmopt.bench.schedule import Load
from llmopt.engine.args import EngineArgs
from llmopt.errors import UserInputError
from llmopt.speculative.config import bench_speculative_config


def test_bench_spec_reports_speedup_and_acceptance(tiny_factory):
    model = tiny_factory(tokenizer=True, max_position_embeddings=512)
    spec = bench_speculative_config("draft_model", str(model), 3)          # a self-draft: all accepted
    cfg = BenchConfig(workload=Workload("random", num_prompts=4, random_input_len=16, random_output_len=12),
                      load=Load(max_concurrency=1), sampling=SamplingSpec(temperature=0.0, ignore_eos=True),
                      engine_args=EngineArgs(model=str(model), kv_cache_memory=1 << 24, enforce_eager=True,
                                             speculative_config=spec), spec="draft_model")
    d = run_benchmark(cfg).results[0].to_dict()
    c = d["compare_spec"]
    assert c["method"] == "draft_model" and c["num_speculative_tokens"] == 3
    assert c["speedup"] == pytest.approx(c["spec_output_throughput"] / c["plain_output_throughput"])
    assert c["spec_output_throughput"] == pytest.approx(d["output_throughput"])
    assert c["outputs_identical"] is True
    assert c["acceptance_length"] == d["spec_decode_acceptance_length"] == \
        1 + d["spec_decode_accepted_tokens"] / d["spec_decode_num_drafts"]
    assert c["acceptance_length"] > 3   # K = 3 taken on every full step (the last ones are cut by max_tokens)
    assert c["acceptance_rate_per_pos"][0] == 1.0
    assert d["spec_decode_acceptance_rate"] == 100.0


def test_bench_spec_flags():
    assert bench_speculative_config() is None
    c = bench_speculative_config("ngram")
    assert c.num_speculative_tokens == 4 and c.prompt_lookup_min == 5
    assert bench_speculative_config("none", config='{"method": "ngram", "num_speculative_tokens": 2}').method == "ngram"
    for kw in [dict(method="eagle", config='{"method": "ngram", "num_speculative_tokens": 2}'),
               dict(method="none", model="x"), dict(method="eagle")]:
        with pytest.raises(UserInputError):
            bench_speculative_config(**kw)
