"""scripts/bench_serve_peers.py's plain transformers + FastAPI server, so the benchmark cannot rot: on
a tiny random model (SmolLM2's tokenizer), in-process under uvicorn, streamed completions through
the `llmopt bench` client come back with the right token counts, and the text is transformers'
own greedy generation."""

from __future__ import annotations

import importlib.util

import httpx
import pytest
import torch
from conftest import REPO
from serve_util import inprocess_server

from llmopt.bench.config import BenchConfig, SamplingSpec
from llmopt.bench.datasets import WorkloadSpec
from llmopt.bench.runner import run_benchmark
from llmopt.bench.schedule import Load


def _script():
    spec = importlib.util.spec_from_file_location("bench_serve_peers", REPO / "scripts" / "bench_serve_peers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def plain(tiny_factory):
    model = tiny_factory(tokenizer=True, max_position_embeddings=512)
    server = _script().PlainServer(model, model_name="tiny")
    with inprocess_server(server.app()) as url:
        yield server, url, model


def test_streamed_completions_through_llmopt_bench(plain):
    server, url, model = plain
    cfg = BenchConfig(base_url=url, tokenizer=str(model), sampling=SamplingSpec(ignore_eos=True),
                      workload=WorkloadSpec("random", num_prompts=2, random_input_len=16, random_output_len=8),
                      load=Load(max_concurrency=2))
    res = run_benchmark(cfg).results[0]
    s = res.summary
    assert s.completed == 2 and s.failed == 0, [r.error for r in res.records]
    assert s.total_input_tokens == 32 and s.total_output_tokens == 16
    for rec in res.records:
        assert rec.output_tokens == 8                       # the server's usage
        assert 0 < rec.ttft <= rec.latency
        assert len(rec.itl) <= 7
    assert res.to_dict()["output_throughput"] > 0


def test_text_is_transformers_greedy(plain):
    server, url, model = plain
    prompt = "The capital of France is"
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 6,
                                                  "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length"
    ids = server.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        ref = server.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                                    do_sample=False, pad_token_id=server.tokenizer.eos_token_id)
    assert body["choices"][0]["text"] == server.tokenizer.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"
