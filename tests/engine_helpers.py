"""Helpers for the engine tests: transformers' greedy generate (one prompt at a time) as the
reference, random prompts, running an engine to the end, and the no-leaked-blocks check. Tiny
checkpoints come from conftest's make_tiny."""

from __future__ import annotations

import random
from pathlib import Path

import torch


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool = False) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding anywhere)."""
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        kw = {} if stop_at_eos else dict(eos_token_id=-1)  # no id matches: run to max_new_tokens
        with torch.no_grad():
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=0, **kw)
        outs.append(g[0, len(p):].tolist())
    return outs


def mixed_prompts(n: int, vocab: int, lo: int = 1, hi: int = 70, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    """n random prompts of mixed lengths; the first `shared_prefix` tokens equal in all (prefix-cache hits)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_engine(engine, prompts, params) -> list[list[int]]:
    """Add every prompt, step to the end; the token ids of each prompt's first completion."""
    return [o.outputs[0].token_ids for o in run_outputs(engine, prompts, params)]


def run_outputs(engine, prompts, params) -> list:
    """Add every prompt, step to the end; each prompt's final RequestOutput, in order."""
    ids = [engine.add_request(f"p{i}", p, params) for i, p in enumerate(prompts)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def check_no_leak(engine) -> None:
    """Every block is back in the free queue with no reference, and no request holds blocks."""
    pool = engine.kv.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks and not engine.kv.req_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks) and not engine.kv.copies
