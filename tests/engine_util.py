"""Helpers for the engine tests: a tiny random Llama saved to disk, and transformers' greedy
generate (one prompt at a time) as the reference."""

from __future__ import annotations

import random
from pathlib import Path

import torch

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.2,
            tie_word_embeddings=False)


def save_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(path)
    return path


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
