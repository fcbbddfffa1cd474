"""Verification is exact: with drafts that are perfect, half wrong or all wrong, greedy outputs equal
plain decoding's token for token, also with repetition / frequency / presence penalties, min_tokens
(EOS and stop ids blocked until the drafts before a row reach it) and stop strings; seeded sampling
with speculation runs and finishes with the same lengths and stop reasons rules."""


import pytest

from engine_helpers import check_no_leak
from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.speculative.interface import DraftProposal, ProposeInput, Proposer
from llmopt.core.sampling_params import SamplingParams
from llmopt.models.loader import load_model
from llmopt.speculative.config import SpeculativeConfig

PROMPTS = ["The cat sat on the", "Once upon a time", "def main():", "1, 2, 3, 4,", "Paris is the capital of",
           "The quick brown fox", "Hello, my name is", "In 1905, Einstein"]


@pytest.fixture(scope="module")
def tok_tiny(tiny_factory):
    path = tiny_factory(tokenizer=True, seed=3)
    return path, load_model(str(path), "float32", "cpu")


def _run(path, loaded, params, drafter=None):
    engine = LLMEngine(EngineArgs(model=str(path), kv_cache_memory=1 << 22, block_size=4), loaded=loaded)
    if drafter is not None:
        engine.set_proposer(drafter)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"p{i}", p, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    check_no_leak(engine)
    return [done[f"p{i}"] for i in range(len(PROMPTS))], steps


class Oracle(Proposer):
    """Drafts from the reference outputs: right, half right or all wrong."""

    def __init__(self, ref, kind: str, k: int) -> None:
        super().__init__(SpeculativeConfig(method="ngram", num_speculative_tokens=k))
        self.ref, self.kind, self.k = ref, kind, k

    def propose(self, batch: ProposeInput) -> DraftProposal:
        out = {}
        for r in batch.requests:
            want = self.ref[int(r.request_id[1:])].token_ids[r.num_output_tokens:r.num_output_tokens + self.k]
            if self.kind == "half":
                want = want[:len(want) // 2] + [(t + 7) % 1000 for t in want[len(want) // 2:]]
            elif self.kind == "wrong":
                want = [(t + 7) % 1000 for t in want]
            out[r.request_id] = want
        return DraftProposal(out)


def _oracle(ref, kind, k=4):
    return Oracle(ref, kind, k)


def _params(tok_tiny, case):
    path, loaded = tok_tiny
    base = dict(temperature=0.0, max_tokens=20, ignore_eos=True)
    if case == "repetition":
        return SamplingParams(**base, repetition_penalty=1.3)
    if case == "frequency":
        return SamplingParams(**base, frequency_penalty=1.0, presence_penalty=0.5)
    plain, _ = _run(path, loaded, SamplingParams(**base))
    if case == "min_tokens":   # ids that would come early are blocked until 10 outputs; one comes by 12
        stop = {t for o in plain for t in o.token_ids[:10]}
        first, _ = _run(path, loaded, SamplingParams(**base, stop_token_ids=sorted(stop), min_tokens=10))
        stop |= {o.token_ids[12] for o in first}
        return SamplingParams(**base, stop_token_ids=sorted(stop), min_tokens=10)
    texts = [loaded.tokenizer.decode([o.token_ids[10]]).strip() for o in plain]
    return SamplingParams(**base, stop=[t for t in texts if t], min_tokens=3)


@pytest.mark.parametrize("case", ["repetition", "frequency", "min_tokens", "stop"])
def test_greedy_identity_with_drafts(tok_tiny, case):
    path, loaded = tok_tiny
    params = _params(tok_tiny, case)
    ref, plain_steps = _run(path, loaded, params)
    if case in ("min_tokens", "stop"):
        assert any(o.finish_reason == "stop" for o in ref)   # the stop condition really fires
    for kind in ("oracle", "half"):
        got, steps = _run(path, loaded, params, _oracle(ref, kind))
        assert [o.token_ids for o in got] == [o.token_ids for o in ref], kind
        assert [o.text for o in got] == [o.text for o in ref], kind
        assert [(o.finish_reason, o.stop_reason) for o in got] == [(o.finish_reason, o.stop_reason) for o in ref]
        if kind == "oracle":
            assert steps < plain_steps / 2


def test_seeded_sampling_with_drafts_is_reproducible(tok_tiny):
    path, loaded = tok_tiny
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=11, repetition_penalty=1.2,
                            ignore_eos=True)
    ref, _ = _run(path, loaded, params)
    a, _ = _run(path, loaded, params, _oracle(ref, "half"))
    b, _ = _run(path, loaded, params, _oracle(ref, "half"))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 16 for o in a)
