"""Helpers of the tensor-parallel tests: engines at a tensor-parallel size (rank 0 in this process,
the other ranks spawned, one thread each), the same scheduled steps on two runners, and the
relative error the issue measures (max|Δ| / max|ref|)."""

from __future__ import annotations

import contextlib

import torch

from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.core.scheduler import ScheduledRequest, SchedulerOutput

PROMPTS = ([3, 17, 5, 90, 44, 2, 8, 61, 12], [7, 1, 33, 4, 20])


@contextlib.contextmanager
def tp_engine(model, tp: int, **kw):
    """LLMEngine over `tp` ranks (greedy-friendly defaults), shut down after the block."""
    args = dict(model=str(model), kv_cache_memory=1 << 20, max_model_len=64, detokenize=False,
                tensor_parallel_size=tp)
    engine = LLMEngine(EngineArgs(**{**args, **kw}))
    try:
        yield engine
    finally:
        engine.shutdown()


def step_logits(runner, prompts=PROMPTS) -> list[torch.Tensor]:
    """Logits of two raw steps through `runner` (a ModelRunner or a TPExecutor): every prompt's
    prefill (logits of every position) in one batch, then one decode token each (reads the cache)."""
    first = SchedulerOutput([ScheduledRequest(f"r{i}", list(p), 0, [i], len(p)) for i, p in enumerate(prompts)])
    second = SchedulerOutput([ScheduledRequest(f"r{i}", [11 + i], len(p), [i], 1) for i, p in enumerate(prompts)])
    return [runner.execute(first).clone(), runner.execute(second).clone()]


def rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    assert ref.shape == got.shape
    return float((ref - got).abs().max() / ref.abs().max())


def greedy(engine, prompts, max_tokens: int = 8) -> list[list[int]]:
    from llmopt.core.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", list(p), params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"g{i}"] for i in range(len(prompts))]
