"""Speculation on the default model (SmolLM2-135M): greedy outputs identical with it on and off for
n-gram, a LayerSkip-style self-draft (its first 8 layers, written by write_self_draft), an
untrained EAGLE-3 head (exactness does not depend on the head) and the committed trained head,
2 prompts x 24 tokens each (the trained head: 1.22 acceptance length there, the untrained 1.0)."""

import pytest

from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.core.sampling_params import SamplingParams
from llmopt.models.loader import load_model
from llmopt.speculative.draft_model import write_self_draft
from llmopt.speculative.eagle import new_head, save_head
from engine_helpers import check_no_leak, run_engine

PROMPTS = ["The capital of France is Paris. The capital of France is", "def add(a, b):\n    return a + b\n\ndef"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.1)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    loaded = load_model(None, "float32", "cpu")
    base = tmp_path_factory.mktemp("smol-spec")
    draft = write_self_draft("smollm2-135m", 8, base / "self-draft")   # from the GGUF, dequantized
    save_head(new_head(loaded.config, "eagle3", list(range(0, 8192)), seed=0), base / "eagle3")
    return loaded, {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                              "prompt_lookup_max": 4},
                    "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
                    "eagle3": {"method": "eagle3", "model": str(base / "eagle3"), "num_speculative_tokens": 3}}


def _run(loaded, spec):
    engine = LLMEngine(EngineArgs(kv_cache_memory=1 << 26, max_model_len=512, enforce_eager=True, speculative_config=spec),
                       loaded=loaded)
    got = run_engine(engine, PROMPTS, PARAMS)
    check_no_leak(engine)
    return got, engine.stats().spec_decoding


def test_smollm2_greedy_identity_per_method(smol):
    loaded, specs = smol
    ref, _ = _run(loaded, None)
    for name, spec in specs.items():
        got, st = _run(loaded, spec)
        assert got == ref, name
        assert st.num_drafts > 0, name
        if name == "draft_model":    # the model's own first 8 of 30 layers: some drafts are taken
            assert st.num_accepted_tokens > 0, name


def test_the_committed_benchmark_head_drafts_what_smollm2_says(smol):
    """recipes/smollm2-135m-eagle3 (the trained head committed for the default model, with its spec_config.json)
    loads through --speculative-config DIR, keeps greedy outputs identical, and its drafts are taken
    far more often than an untrained head's (a broken or mismatched file would draft noise)."""
    from pathlib import Path
    from llmopt.speculative.config import parse_speculative_config
    loaded, specs = smol
    folder = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m-eagle3"
    cfg = parse_speculative_config(str(folder))
    assert cfg.method == "eagle3" and Path(cfg.model) == folder / "head"
    spec = {"method": "eagle3", "model": cfg.model, "num_speculative_tokens": 3}
    ref, _ = _run(loaded, None)
    got, trained = _run(loaded, spec)
    _, untrained = _run(loaded, specs["eagle3"])
    assert got == ref
    assert trained.mean_acceptance_length > 1.15 and untrained.mean_acceptance_length < 1.05, \
        (trained.mean_acceptance_length, untrained.mean_acceptance_length)
