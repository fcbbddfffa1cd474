"""serve with --speculative-config: completions equal plain decoding's, and /metrics carries vLLM's
spec_decode_* counters (per position with a `position` label) that match the engine's."""

import httpx
import pytest

from llmopt.engine.args import EngineArgs
from llmopt.engine.async_engine import AsyncLLMEngine
from llmopt.engine.engine import LLMEngine
from llmopt.models.loader import load_model
from llmopt.serve.api_server import build_app
from llmopt.serve.server import ServeConfig
from serve.serve_util import ENGINE_ARGS, TINY_CHAT, inprocess_server, metrics

PROMPTS = ["a b c a b c a b", "one two three one two three one", "x y x y x y x"]


@pytest.fixture(scope="module")
def model(tiny_factory):
    return tiny_factory(**TINY_CHAT)


def _complete(model, loaded, spec):
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(model=str(model), speculative_config=spec, **ENGINE_ARGS),
                                      loaded=loaded))
    with inprocess_server(build_app(engine, ServeConfig(model_name="tiny", log_interval=0))) as url:
        http = httpx.Client(base_url=url, timeout=60)
        texts = [http.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 12,
                                                    "temperature": 0}).json()["choices"][0]["text"]
                 for p in PROMPTS]
        return texts, metrics(http), engine.engine.stats()


def test_serve_reports_spec_decode_metrics(model):
    loaded = load_model(str(model), "auto", "cpu")
    plain, m0, _ = _complete(model, loaded, None)
    assert not any(k.startswith("llmopt:spec_decode") for k in m0)
    spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}   # a self-draft
    got, m, stats = _complete(model, loaded, spec)
    assert got == plain
    s = stats.spec_decoding
    assert s.num_drafts > 0 and s.num_accepted_tokens == s.num_draft_tokens
    assert m["llmopt:spec_decode_num_drafts_total"] == s.num_drafts
    assert m["llmopt:spec_decode_num_draft_tokens_total"] == s.num_draft_tokens
    assert m["llmopt:spec_decode_num_accepted_tokens_total"] == s.num_accepted_tokens
    per = [m[f"llmopt:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"] for i in range(3)]
    assert per == s.num_accepted_tokens_per_pos and sum(per) == s.num_accepted_tokens
