"""lm-evaluation-harness against `llmopt serve`: its `local-completions` model (echo + logprobs
requests over HTTP) on a local rolling-perplexity task (WikiText-2 passages) and a local
multiple-choice task gives the numbers lm-eval's own `hf` model gives on the same checkpoint,
sample by sample. Both score the same windows: the API model keeps `max_length - 2` tokens a
rolling window where `hf` keeps `max_length`, so it is given 2 more."""

from __future__ import annotations

import os

import pytest

from serve_util import API_KEY, MODEL_NAME, TINY_CHAT, shared_server

HF_MAX_LENGTH = 96


@pytest.fixture(scope="module")
def tiny_chat_model(tiny_factory):
    return tiny_factory(**TINY_CHAT)


@pytest.fixture(scope="module")
def tasks(lm_eval_tasks):
    return lm_eval_tasks


def _evaluate(model: str, model_args: dict, tasks_folder):
    import lm_eval
    from lm_eval.tasks import TaskManager
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["llmopt_rolling", "llmopt_mc"],
                                   task_manager=TaskManager(include_path=str(tasks_folder)), log_samples=True,
                                   batch_size=2, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0)


def _scores(result: dict, task: str) -> list:
    return [r[0] if isinstance(r, (list, tuple)) else r
            for s in sorted(result["samples"][task], key=lambda s: s["doc_id"]) for r in s["filtered_resps"]]


def test_local_completions_against_the_server_matches_lm_evals_hf_model(tiny_chat_model, tmp_path_factory, tasks):
    server = shared_server(tiny_chat_model, tmp_path_factory.mktemp("serve-log"))
    ours = _evaluate("local-completions", {
        "model": MODEL_NAME, "base_url": f"{server.url}/v1/completions", "tokenizer": str(tiny_chat_model),
        "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_length": HF_MAX_LENGTH + 2,
        "header": {"Authorization": f"Bearer {API_KEY}"}, "max_retries": 1}, tasks)
    ref = _evaluate("hf", {"pretrained": str(tiny_chat_model), "dtype": "float32", "max_length": HF_MAX_LENGTH,
                           "device": "cpu"}, tasks)
    for task in ("llmopt_rolling", "llmopt_mc"):
        got, want = _scores(ours, task), _scores(ref, task)
        assert len(got) == len(want) == {"llmopt_rolling": 4, "llmopt_mc": 24}[task]
        flat = [float(x[0]) if isinstance(x, (list, tuple)) else float(x) for x in got]
        flat_want = [float(x[0]) if isinstance(x, (list, tuple)) else float(x) for x in want]
        assert flat == pytest.approx(flat_want, rel=1e-4, abs=1e-3), task
    r, w = ours["results"], ref["results"]
    assert r["llmopt_rolling"]["word_perplexity,none"] == pytest.approx(w["llmopt_rolling"]["word_perplexity,none"],
                                                                        rel=1e-4)
    assert r["llmopt_mc"]["acc,none"] == w["llmopt_mc"]["acc,none"]
    assert r["llmopt_mc"]["acc_norm,none"] == w["llmopt_mc"]["acc_norm,none"]
