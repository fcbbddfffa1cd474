"""Sliding windows in the engine: blocks out of every window are freed as a request decodes, so a
pool of a few windows' blocks serves a context far longer than itself, with the tokens it would
generate holding every block, and the engine's admission check agrees with kv-estimate."""

from __future__ import annotations

import pytest
import torch

from llmopt.core.sampling_params import SamplingParams
from llmopt.errors import UserInputError

WINDOW, BLOCK, BATCHED = 32, 16, 64


@pytest.fixture(scope="module")
def mistral(tiny_factory):
    return tiny_factory(weight_std=0.2, model_type="mistral", sliding_window=WINDOW, max_position_embeddings=2048)


def _engine(path, blocks: int, block_layers: int | None = None, **kw):
    """An engine whose cache holds `blocks` blocks of `block_layers` layers (default: all)."""
    from llmopt.engine.args import EngineArgs
    from llmopt.engine.engine import LLMEngine
    from llmopt.kernels import kv_block_bytes
    from llmopt.models.loader import load_model
    loaded = load_model(str(path), "float32", "cpu", tokenizer=False)
    cfg = loaded.config
    memory = blocks * (block_layers or cfg.num_hidden_layers) * kv_block_bytes(BLOCK, cfg.num_key_value_heads,
                                                                               cfg.head_dim, "float32", torch.float32)
    args = EngineArgs(model=str(path), dtype="float32", device="cpu", detokenize=False, block_size=BLOCK,
                      kv_cache_memory=memory, kv_cache_dtype="float32", max_num_batched_tokens=BATCHED, **kw)
    return LLMEngine(args, loaded=loaded)


def _generate(engine, prompts, max_tokens):
    """Greedy tokens per prompt; the most blocks any request held after a step."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    out, most = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
        most = max([most] + [engine.kv.num_held_blocks(r.request_id) for r in engine.scheduler.running])
        engine.kv.pool.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks   # every block back
    return [out[f"r{i}"] for i in range(len(prompts))], most


def test_a_window_model_generates_far_past_its_pool(mistral):
    """16 blocks (256 tokens) serve a 100-token prompt and 1,000 generated tokens: the request never
    holds more than the window's blocks, kv-estimate plans the same count, and the tokens equal
    those of a pool large enough to keep every block (nothing freed is ever read)."""
    from llmopt.cache.kv_manager import request_blocks
    from llmopt.estimate import estimate, resolve_model_arch
    engine = _engine(mistral, 16, max_model_len=2048)
    assert engine.kv.sliding_window == WINDOW
    per = request_blocks(2048, BLOCK, WINDOW, BATCHED)
    assert per == -(-(WINDOW - 1 + BATCHED) // BLOCK) + 1 == 7 == engine.blocks_per_request
    est = estimate(resolve_model_arch(str(mistral)), kv_cache_dtype="float32", block_size=BLOCK,
                   kv_cache_memory=engine.runner.kv_cache_info().bytes_allocated, max_model_len=2048,
                   max_num_batched_tokens=BATCHED)
    assert est.paged.num_blocks == 16 and est.paged.groups[0]["blocks_per_request"] == per
    prompt = torch.randint(0, 96, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    got, most = _generate(engine, [prompt], 1000)
    assert len(got[0]) == 1000 and most <= per
    full = _engine(mistral, 80, max_model_len=2048)
    full.kv.keep_all_blocks()    # holds every block: what the freed ones would have held
    want, most_full = _generate(full, [prompt], 1000)
    assert got == want and most_full == -(-1100 // BLOCK)


def test_concurrent_window_requests_preempt_and_finish(mistral):
    """Three long requests over a pool of 16 blocks: they take turns (preemption), each finishing
    with the tokens it generates alone."""
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 70, 90)]
    engine = _engine(mistral, 16, max_model_len=1024)
    got, _ = _generate(engine, prompts, 200)
    for p, g in zip(prompts, got):
        assert g == _generate(_engine(mistral, 16, max_model_len=1024), [p], 200)[0][0]


def test_admission_counts_the_window_not_the_context(mistral):
    _engine(mistral, 7, max_model_len=2048)                    # the window's 7 blocks: accepted
    with pytest.raises(UserInputError, match="fewer than the 7 a request holds under its 32-token window"):
        _engine(mistral, 6, max_model_len=2048)


def test_a_proposer_writing_kv_keeps_every_block(mistral):
    """A draft that writes its own K/V over the request's blocks reads them all: no freeing, and a
    pool too small for a whole context is refused."""
    from types import SimpleNamespace
    engine = _engine(mistral, 200, max_model_len=2048)
    proposer = SimpleNamespace(writes_kv=True, hidden_layers=None, method="draft_model",
                               config=SimpleNamespace(num_speculative_tokens=2))
    engine.set_proposer(proposer)
    assert engine.kv.sliding_window is None and engine.blocks_per_request == 128
    small = _engine(mistral, 16, max_model_len=2048)
    with pytest.raises(UserInputError, match="without freeing out-of-window blocks"):
        small.set_proposer(proposer)


@pytest.fixture(scope="module")
def hybrid(tiny_factory):
    """Qwen2 with windows on the layers from max_window_layers on: 2 full layers, 2 windowed."""
    return tiny_factory(weight_std=0.2, model_type="qwen2", num_hidden_layers=4, use_sliding_window=True,
                        sliding_window=WINDOW, max_window_layers=2, max_position_embeddings=2048)


def test_hybrid_groups_free_the_windowed_layers_blocks(hybrid):
    """Two KV-cache groups (full layers 0-1, windowed 2-3) sharing tensors: the windowed group holds
    the window's 7 blocks while the full one keeps all 69 of 1,100 tokens; the engine admits what
    kv-estimate plans for vLLM's hybrid allocator, and generates the tokens of one shared table."""
    from llmopt.cache.kv_manager import request_blocks
    from llmopt.estimate import estimate, resolve_model_arch
    engine = _engine(hybrid, 80, block_layers=2, max_model_len=1100)
    assert [g.window for g in engine.kv.groups] == [None, WINDOW]
    assert engine.runner.key_caches[0] is engine.runner.key_caches[2]   # layer j of each group: one tensor
    per = request_blocks(1100, BLOCK) + request_blocks(1100, BLOCK, WINDOW, BATCHED)
    assert per == 69 + 7 == engine.blocks_per_request
    est = estimate(resolve_model_arch(str(hybrid)), kv_cache_dtype="float32", block_size=BLOCK,
                   kv_cache_memory=engine.runner.kv_cache_info().bytes_allocated, max_model_len=1100,
                   max_num_batched_tokens=BATCHED)
    assert est.paged.layout == "hybrid" and est.paged.num_blocks == engine.kv.pool.num_blocks == 80
    assert sum(g["blocks_per_request"] for g in est.paged.groups) == per
    prompt = torch.randint(0, 96, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    got, most = _generate(engine, [prompt], 1000)
    assert 69 < most <= per   # both groups: all 69 blocks of the full one, a window of the other (80 < 2 x 69)
    one = _engine(hybrid, 70, max_model_len=1100, disable_hybrid_kv_cache_manager=True)
    assert len(one.kv.groups) == 1 and not one.kv.frees_blocks
    assert got == _generate(one, [prompt], 1000)[0]
    with pytest.raises(UserInputError, match="in its 2 KV-cache groups"):
        _engine(hybrid, 75, block_layers=2, max_model_len=1100)


def test_hybrid_engine_matches_transformers_and_hits_its_prefix_cache(hybrid):
    """Greedy tokens as transformers' Qwen2 with its windowed layers, on prompts longer than the
    window; the same prompts again hit the prefix cache in both groups and give the same tokens."""
    from engine_helpers import hf_greedy, hf_model
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 45, 90)]
    engine = _engine(hybrid, 200, block_layers=2, max_model_len=512)
    got, _ = _generate(engine, prompts, 12)
    assert got == hf_greedy(hf_model(hybrid), prompts, 12)
    hits = engine.stats().prefix_cache_hits
    again, _ = _generate(engine, prompts, 12)
    assert again == got and engine.stats().prefix_cache_hits - hits >= 16 * (4 + 2 + 5)
