"""The engine's plug-in contracts: any Proposer drafts through the engine without touching blocks
(the scheduler allocates its lookahead slots and rewinds rejected drafts), the runner returns the
hidden states a proposer asks for, and the engine imports no implementation of its plug-ins (the
drafters of llmopt.speculative, llmopt.distributed) until a config asks for them."""

import subprocess
import sys
from dataclasses import dataclass

import pytest

from engine_helpers import check_no_leak, mixed_prompts, run_engine
from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.speculative.interface import DraftProposal, ProposeInput, Proposer, StepHiddenStates
from llmopt.core.sampling_params import SamplingParams
from llmopt.models.loader import load_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@dataclass
class FixedK:
    """A DraftConfig: K drafts at every batch size."""
    num_speculative_tokens: int
    method: str = "toy"

    def num_tokens_for_batch(self, batch_size: int) -> int:
        return self.num_speculative_tokens


class Repeater(Proposer):
    """Drafts the last token k times (mostly wrong), pretending to write draft K/V; checks on
    every call that the scheduler gave it lookahead slots for all its drafts."""
    writes_kv = True

    def __init__(self, engine: LLMEngine, k: int, hidden_layers=None) -> None:
        super().__init__(FixedK(k))
        self.engine, self.hidden_layers = engine, hidden_layers
        self.calls = 0
        self.observed: list[StepHiddenStates | None] = []

    def propose(self, batch: ProposeInput) -> DraftProposal:
        self.calls += 1
        kv = self.engine.kv
        for r in batch.requests:
            k = batch.num_draft_tokens[r.request_id]
            assert 1 <= k <= self.num_draft_tokens(1)
            table = batch.block_ids[r.request_id]
            assert table == kv.get_block_ids(r.request_id)       # the scheduler's KV manager's blocks
            assert len(table) * kv.block_size >= r.num_tokens + k    # lookahead slots for every draft
        return DraftProposal({r.request_id: [r.all_token_ids[-1]] * batch.num_draft_tokens[r.request_id]
                              for r in batch.requests})

    def observe(self, hidden: StepHiddenStates | None) -> None:
        self.observed.append(hidden)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama, load_model(str(tiny_llama), "float32", "cpu", tokenizer=False)


def _engine(tiny, **kw) -> LLMEngine:
    path, loaded = tiny
    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLMEngine(EngineArgs(model=str(path), detokenize=False, block_size=4, **kw), loaded=loaded)


def test_a_proposer_plugs_in_and_never_changes_greedy_outputs(tiny):
    prompts = mixed_prompts(6, 96, lo=3, hi=30, seed=2)
    ref = run_engine(_engine(tiny), prompts, GREEDY)
    engine = _engine(tiny)
    toy = Repeater(engine, 3)
    engine.set_proposer(toy)
    assert engine.scheduler.hidden_layers is None
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        for r in engine.scheduler.running:
            # rejected drafts are rewound: only the last sampled token is left to compute, and no draft
            # outlives the step; every block the request holds is one of the pool's, referenced
            assert r.num_computed_tokens == r.num_tokens - 1 and r.spec_token_ids == []
            assert all(engine.kv.pool.blocks[b].ref_cnt > 0 for b in engine.kv.get_block_ids(r.request_id))
    assert [done[f"p{i}"] for i in range(len(prompts))] == ref
    st = engine.stats().spec_decoding
    assert toy.calls > 0 and st.method == "toy" and st.num_drafts > 0 and st.num_draft_tokens <= 3 * st.num_drafts
    assert toy.observed == []      # it asked for no hidden states
    check_no_leak(engine)


def test_lookahead_slots_that_do_not_fit_mean_no_drafts(tiny):
    """A proposer that writes K/V drafts only where the scheduler found lookahead slots; with too
    few blocks it drafts less, and the outputs stay the same."""
    prompts = mixed_prompts(8, 96, lo=10, hi=20, seed=5)
    small = dict(kv_cache_memory=256 * 4 * 40, max_model_len=48)    # 40 blocks of 4 tokens
    ref = run_engine(_engine(tiny, **small), prompts, GREEDY)
    engine = _engine(tiny, **small)
    engine.set_proposer(Repeater(engine, 6))
    assert run_engine(engine, prompts, GREEDY) == ref
    check_no_leak(engine)


def test_the_runner_returns_the_hidden_states_a_proposer_asks_for(tiny):
    engine = _engine(tiny)
    toy = Repeater(engine, 2, hidden_layers=(1,))
    engine.set_proposer(toy)
    assert engine.scheduler.schedule().hidden_layers == (1,)
    prompts = mixed_prompts(3, 96, lo=5, hi=12, seed=7)
    run_engine(engine, prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert toy.observed and all(h is not None for h in toy.observed)
    hidden = engine.loaded.config.hidden_size
    for h in toy.observed:
        n = sum(count for _, _, count in h.rows)
        assert h.states.final.shape == (n, hidden) and len(h.states.layers) == 1
        assert h.states.layers[0].shape == (n, hidden)
    assert engine.loaded.model.capture_hidden is None and engine.loaded.model.captured is None   # only per step
    check_no_leak(engine)


def test_the_engine_imports_no_plug_in_until_asked():
    code = ("import sys, llmopt.engine.engine, llmopt.engine.llm, llmopt.engine.async_engine; "
            "print(sorted(m for m in sys.modules if m.startswith(('llmopt.speculative', 'llmopt.distributed'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # the interface and the config parser, no drafter and nothing of tensor parallelism
    assert out.strip() == str(["llmopt.speculative", "llmopt.speculative.config", "llmopt.speculative.interface"])
