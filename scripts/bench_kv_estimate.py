"""Accuracy table for `llmopt kv-estimate`: (1) the estimate against what LLMEngine really allocates
for the default model (SmolLM2-135M) for each KV dtype the engine supports, (2) the seed's naive
formula (2 x layers x hidden x seq x batch x bytes) against the real paged accounting for every
preset at 32k tokens, (3) the time one estimate takes.

    python scripts/bench_kv_estimate.py --kv-cache-memory 268435456 --out /tmp/bench-kv-estimate.json
"""

from __future__ import annotations

import argparse
import json
import time

from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.estimate import estimate, resolve_model_arch
from llmopt.estimate.presets import MODEL_PRESETS
from llmopt.models.loader import load_model


def engine_rows(memory: int) -> list[dict]:
    loaded = load_model(None, "float32", "cpu")
    arch = resolve_model_arch(str(loaded.path))          # the converted checkpoint the engine runs
    out = []
    for engine_kv, est_kv in (("auto", "float32"), ("fp8", "fp8"), ("fp8_e5m2", "fp8_e5m2"), ("int8", "int8"),
                              ("int4", "int4"), ("kivi2", "kivi2")):
        args = EngineArgs(dtype="float32", device="cpu", kv_cache_memory=memory, kv_cache_dtype=engine_kv,
                          max_model_len=2048)
        info = LLMEngine(args, loaded=loaded).kv_cache_info()
        est = estimate(arch, kv_cache_dtype=est_kv, kv_cache_memory=memory, max_model_len=2048,
                       max_num_batched_tokens=args.max_num_batched_tokens)   # kivi2's residual pool holds a step
        out.append({"kv_dtype": engine_kv, "engine_blocks": info.num_blocks, "estimated_blocks": est.paged.num_blocks,
                    "engine_residual_blocks": info.num_residual_blocks,
                    "estimated_residual_blocks": est.paged.residual_blocks,
                    "engine_bytes": info.bytes_allocated, "estimated_bytes": est.paged.kv_cache_bytes})
    return out


def naive_rows(seq_len: int) -> list[dict]:
    out = []
    for p in MODEL_PRESETS:
        est = estimate(resolve_model_arch(p.hf_id), kv_cache_dtype="bf16", max_model_len=seq_len, naive=True)
        n = est.naive
        out.append({"model": p.hf_id, "attention": est.attention, "bytes_per_token": est.bytes_per_token,
                    "naive_gib": n.naive_bytes / 2**30, "real_gib": n.real_bytes / 2**30, "naive_over_real": n.ratio})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t = time.perf_counter()
    arch = resolve_model_arch("meta-llama/Llama-3.1-70B")
    for _ in range(20):
        estimate(arch, gpu="H200", tensor_parallel_size=2, kv_cache_dtype="fp8", max_model_len=32768, what_if=True)
    per_estimate = (time.perf_counter() - t) / 20
    result = {"engine": engine_rows(a.kv_cache_memory), "naive": naive_rows(a.seq_len),
              "seconds_per_estimate_70b_with_what_if": per_estimate}
    print("| KV dtype | engine blocks (+ residual) | estimated blocks (+ residual) | engine bytes | estimated bytes |")
    print("|---|---:|---:|---:|---:|")
    for r in result["engine"]:
        res = [f" + {r[k]:,}" if r[k] else "" for k in ("engine_residual_blocks", "estimated_residual_blocks")]
        print(f"| {r['kv_dtype']} | {r['engine_blocks']:,}{res[0]} | {r['estimated_blocks']:,}{res[1]} | "
              f"{r['engine_bytes']:,} | {r['estimated_bytes']:,} |")
    print(f"\n| model | attention | KV B/token (bf16) | naive GiB @{a.seq_len:,} | real GiB | naive / real |")
    print("|---|---|---:|---:|---:|---:|")
    for r in result["naive"]:
        print(f"| {r['model']} | {r['attention']} | {r['bytes_per_token']:,} | {r['naive_gib']:.2f} | "
              f"{r['real_gib']:.2f} | {r['naive_over_real']:.2f}x |")
    print(f"\none estimate (Llama-3.1-70B, H200 x2, fp8, what-if levers): {per_estimate * 1000:.1f} ms")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
