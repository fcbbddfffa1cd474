"""What each usual lever buys: the same plan re-run with fp8 KV, quantized weights, twice the GPUs,
or the longest context that fits — so the output says what to change, not only whether it fits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from llmopt.errors import LLMOptError


@dataclass
class WhatIf:
    change: str                 # the flag(s) to add
    fits: bool | None
    max_concurrency: float | None
    longest_context: int | None
    weights_per_gpu_bytes: int
    kv_cache_bytes: int | None


def what_ifs(est, run: Callable[..., Any], kwargs: dict[str, Any]) -> list[WhatIf]:
    """`run(**kwargs)` re-estimates; `est` is the base estimate (with a memory budget)."""
    options: list[tuple[str, dict[str, Any]]] = []
    if est.kv_cache_dtype in ("float32", "bfloat16", "float16"):
        options.append(("--kv-cache-dtype fp8", {"kv_cache_dtype": "fp8"}))
    fmt = est.weights.format
    if fmt in ("bfloat16", "float16", "float32", "bf16", "fp16", "fp32"):
        options.append(("--weight-format fp8", {"weight_format": "fp8"}))
        options.append(("--weight-format int4", {"weight_format": "int4"}))
    tp = est.tensor_parallel_size
    options.append((f"--tensor-parallel-size {2 * tp}", {"tensor_parallel_size": 2 * tp}))
    if est.paged and est.paged.num_blocks < est.paged.blocks_per_request and est.paged.longest_context > 0:
        options.append((f"--max-model-len {est.paged.longest_context}", {"max_model_len": est.paged.longest_context}))
    out = []
    for change, extra in options:
        alt = _try(run, {**kwargs, **extra})
        if alt is not None:
            out.append(_row(change, alt))
    if est.fits is False and not any(w.fits for w in out if w.change.startswith("--tensor")):
        for n in (4 * tp, 8 * tp, 16 * tp, 32 * tp, 64 * tp):   # the smallest replica that fits
            alt = _try(run, {**kwargs, "tensor_parallel_size": n})
            if alt is not None and alt.fits:
                out.append(_row(f"--tensor-parallel-size {n}", alt))
                break
    return out


def _try(run, kwargs):
    try:
        return run(**kwargs)
    except LLMOptError:           # e.g. the ranks do not divide the heads: not a lever for this model
        return None


def _row(change: str, alt) -> WhatIf:
    p = alt.paged
    return WhatIf(change, alt.fits, p.max_concurrency if p else None, p.longest_context if p else None,
                  alt.weights.bytes_per_rank, p.kv_cache_bytes if p else None)
