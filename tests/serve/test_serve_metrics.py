"""/metrics against vLLM's v1 metrics (vllm/v1/metrics/loggers.py and stats.py): the per-request
histograms count what the requests really had (prompt lengths from /tokenize, generated tokens
from the logprobs and usage, the n and max_tokens sent), with vLLM's bucket boundaries, labels and
types; the phases add up (prefill + decode = inference); iteration_tokens_total has one observation
per engine step, of the step's prompt and generated tokens; cache_config_info carries the engine's
KV-cache configuration; the process collectors are there."""

from __future__ import annotations

import math
import re
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_util import KV_BYTES, MAX_MODEL_LEN, MODEL_NAME, TINY_CHAT, metrics, shared_server, wait_idle

P = "llmopt:"
C, CHAT = "/v1/completions", "/v1/chat/completions"

# vLLM's boundaries, written out from vllm/v1/metrics/loggers.py (build_1_2_5_buckets(max_model_len)
# for token counts: MAX_MODEL_LEN = 256 here)
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0]
TPOT = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
BUCKETS = {
    "request_prompt_tokens": TOKEN_BUCKETS, "request_generation_tokens": TOKEN_BUCKETS,
    "request_params_max_tokens": TOKEN_BUCKETS, "request_max_num_generation_tokens": TOKEN_BUCKETS,
    "request_params_n": [1, 2, 5, 10, 20],
    "iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "request_prefill_time_seconds": LATENCY, "request_decode_time_seconds": LATENCY,
    "request_inference_time_seconds": LATENCY, "request_queue_time_seconds": LATENCY,
    "e2e_request_latency_seconds": LATENCY, "request_time_per_output_token_seconds": TPOT,
}
# (endpoint, prompt, max_tokens or None for the default, n); a chat without max_tokens runs to the context
REQUESTS = [(C, "The capital of France is", 5, 1), (C, "Once upon a time there was", 7, 2), (C, "def f(x):", 3, 3),
            (C, "Hello", None, 1), (CHAT, "Hi there", None, 2)]


@pytest.fixture(scope="module")
def server(tiny_factory, tmp_path_factory):
    return shared_server(tiny_factory(**TINY_CHAT), tmp_path_factory.mktemp("serve-log"))


@pytest.fixture(scope="module")
def http(server):
    with server.http() as c:
        yield c


def delta(after: dict, before: dict, name: str) -> float:
    return after[P + name] - before.get(P + name, 0.0)


def observed(after: dict, before: dict, name: str) -> list[float]:
    """A histogram's new observations per bucket (not cumulative), in the order of its boundaries."""
    les = sorted((float(re.search(r"le=([^,}]+)", k).group(1)), k) for k in after
                 if k.startswith(P + name + "_bucket{"))
    cum = [after[k] - before.get(k, 0.0) for _, k in les]
    return [c - p for c, p in zip(cum, [0.0] + cum[:-1])]


def bucket_counts(values: list[float], bounds: list[float]) -> list[float]:
    """The reference: how many of `values` fall in each bucket (le bounds, then +Inf)."""
    out = [0.0] * (len(bounds) + 1)
    for v in values:
        out[next((i for i, b in enumerate(bounds) if v <= b), len(bounds))] += 1
    return out


def test_per_request_histograms_count_what_the_requests_had(http):
    for path, prompt, max_tokens, n in REQUESTS:
        chat = path == CHAT
        text = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        p = http.post("/tokenize", json={"model": MODEL_NAME, **text}).json()["count"]
        body = {"model": MODEL_NAME, **text, "n": n, "ignore_eos": True, "logprobs": True if chat else 1, "seed": 7}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        before = wait_idle(http)
        t0 = time.monotonic()
        r = http.post(path, json=body).json()
        wall = time.monotonic() - t0
        after = metrics(http)
        per_choice = [len(c["logprobs"]["content" if chat else "tokens"]) for c in r["choices"]]
        gen = r["usage"]["completion_tokens"]
        assert r["usage"]["prompt_tokens"] == p and len(per_choice) == n and sum(per_choice) == gen
        # ignore_eos: each sample runs to its limit; the default: 16 in completions (OpenAI's), the context in chat
        limit = max_tokens or (MAX_MODEL_LEN - p if chat else 16)
        assert per_choice == [limit] * n

        def hist(name: str) -> tuple[float, float]:
            return delta(after, before, name + "_count"), delta(after, before, name + "_sum")

        # one observation per sample (vLLM's requests), n and the longest sample once per prompt
        assert hist("request_prompt_tokens") == (n, n * p)
        assert hist("request_generation_tokens") == (n, gen)
        assert hist("request_params_max_tokens") == (n, n * limit)
        assert hist("request_params_n") == (1, n)
        assert hist("request_max_num_generation_tokens") == (1, max(per_choice))
        assert delta(after, before, "request_success_total{finished_reason=length}") == n
        assert observed(after, before, "request_generation_tokens") == bucket_counts(per_choice, TOKEN_BUCKETS)

        # one step per token (a short prompt is one chunk; the samples decode side by side): the first
        # has the n prompts and the n first tokens, each later one n tokens
        steps = [n * p + n] + [n] * (limit - 1)
        assert hist("iteration_tokens_total") == (len(steps), n * p + gen)
        assert observed(after, before, "iteration_tokens_total") == bucket_counts(steps, BUCKETS["iteration_tokens_total"])

        prefill, decode, inference = (hist(f"request_{k}_time_seconds") for k in ("prefill", "decode", "inference"))
        queue, ttft, e2e = hist("request_queue_time_seconds"), hist("time_to_first_token_seconds"), \
            hist("e2e_request_latency_seconds")
        assert prefill[0] == decode[0] == inference[0] == queue[0] == ttft[0] == e2e[0] == n
        assert prefill[1] > 0 and decode[1] > 0 and inference[1] > 0
        assert prefill[1] + decode[1] == pytest.approx(inference[1], rel=1e-9, abs=1e-9)
        assert queue[1] + prefill[1] == pytest.approx(ttft[1], rel=1e-9, abs=1e-9)
        assert inference[1] <= e2e[1] <= n * wall
        # every sample has `limit` tokens: the TPOTs sum to the decode times over limit - 1
        tpot = hist("request_time_per_output_token_seconds")
        assert tpot[0] == n and tpot[1] == pytest.approx(decode[1] / (limit - 1), rel=1e-9)


def families(http) -> dict:
    return {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}


def test_histogram_buckets_labels_and_types_are_vllms(http):
    fams = families(http)
    for name, bounds in BUCKETS.items():
        f = fams[P + name]
        assert f.type == "histogram", name
        les = sorted(float(s.labels["le"]) for s in f.samples if s.name.endswith("_bucket"))
        assert les == [float(b) for b in bounds] + [math.inf], name
        assert all(set(s.labels) - {"le"} == {"model_name", "engine"} for s in f.samples), name
        assert all(s.labels["model_name"] == MODEL_NAME and s.labels["engine"] == "0" for s in f.samples)


def test_cache_config_info_and_process_collectors(http, server):
    fams = families(http)
    info = fams[P + "cache_config_info"]
    assert info.type == "gauge" and len(info.samples) == 1 and info.samples[0].value == 1
    blocks = re.search(r"KV cache: (\d+) blocks of (\d+) tokens", server.log.read_text())
    assert blocks is not None and blocks.group(2) == "16"
    # the flags serve_util starts the server with, and the engine's defaults (defaults.py)
    assert info.samples[0].labels == {"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True",
                                      "gpu_memory_utilization": "0.9", "kv_cache_memory_bytes": str(KV_BYTES),
                                      "num_gpu_blocks": blocks.group(1), "engine": "0"}
    rss = fams["process_resident_memory_bytes"]
    assert rss.type == "gauge" and rss.samples[0].value > 10 << 20   # a Python process with torch: tens of MB
    assert fams["process_cpu_seconds"].samples[0].value > 0
    assert fams["process_open_fds"].samples[0].value > 0
    assert fams["python_info"].samples[0].labels["implementation"] == "CPython"
    assert "python_gc_collections" in fams
