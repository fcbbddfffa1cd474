"""The engine over 2 and 3 ranks (gloo on the CPU; rank 0 here, the others spawned, one thread each)
against one rank: logits within float32 rounding, the same greedy tokens, the KV cache each rank
allocates as kv-estimate plans it; idle workers stay (rank 0 pings them within their step timeout),
a worker that dies is one clear error and nothing hangs."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from llmopt import defaults
from llmopt.engine.engine import EngineDeadError
from llmopt.layers.modules_ggml import GGMLLinear
from llmopt.estimate import estimate, resolve_model_arch
from llmopt.estimate.weights import weight_memory
from llmopt.worker.runner import ModelRunner
from llmopt.models.loader import load_model
from tp_util import greedy, rel_err, step_logits, tp_engine

TINY = {
    # kv heads 2 over 2 ranks (split); o_proj and down_proj biases (added once); vocabulary padded (97 / 2)
    "llama": dict(model_type="llama", attention_bias=True, mlp_bias=True, vocab_size=97),
    # qkv bias; 1 KV head over 2 ranks (replicated); tied embeddings (the head shares the vocab shard)
    "qwen2-kv1": dict(model_type="qwen2", num_key_value_heads=1, tie_word_embeddings=True, vocab_size=96),
    # q/k norms per head
    "qwen3": dict(model_type="qwen3", vocab_size=96),
}


def reference(folder, memory=1 << 20, **kw):
    """TP=1, float activations throughout (the ranks' Python layers have no int8-activation tiles)."""
    loaded = load_model(str(folder), "float32", "cpu", tokenizer=False)
    runner = ModelRunner(loaded, 16, kv_cache_memory=memory, **kw)
    if runner.cpu_decode is not None:
        runner.cpu_decode.set_int8_activations(False)
    return runner


@pytest.mark.parametrize("name", list(TINY))
def test_tp2_logits_equal_tp1_and_kv_as_estimated(tiny_factory, name):
    folder = tiny_factory(tokenizer=True, **TINY[name])
    ref = step_logits(reference(folder))
    memory = (1 << 20) + 4321
    with tp_engine(folder, 2, kv_cache_memory=memory) as engine:
        got = step_logits(engine.runner)
        stats = engine.runner.rank_stats()
        info = engine.kv_cache_info()
    for a, b in zip(ref, got):
        assert rel_err(a, b) <= 1e-5
    est = estimate(resolve_model_arch(str(folder)), tensor_parallel_size=2, device="cpu", kv_cache_memory=memory,
                   max_model_len=64)
    assert est.kv_heads_per_rank == 1
    assert est.paged.num_blocks == info.num_blocks
    assert [s.kv_cache_bytes for s in stats] == [est.paged.kv_cache_bytes] * 2     # every rank, as planned
    assert len({s.pid for s in stats}) == 2 and stats[0].pid == os.getpid()
    assert all(s.threads == 1 for s in stats)


def test_tp3_default_model_generates_as_tp1(monkeypatch):
    """TP=1 and TP=3 both run the GGUF as stored, each rank its slice of the decoded blocks (rows,
    whole 32-column blocks of o_proj / down_proj, vocabulary rows of the tied table): the same
    numbers with float activations (int8 activations round x per 32 columns)."""
    monkeypatch.setattr(defaults, "CPU_DECODE_INT8_ACTIVATIONS", False)
    memory = 16 << 20
    with tp_engine("smollm2-135m", 1, kv_cache_memory=memory) as one:
        ref = step_logits(one.runner)
        prompts = [one.tokenize("The capital of France is"), one.tokenize("def fibonacci(n):")]
        want = greedy(one, prompts)
    with tp_engine("smollm2-135m", 3, kv_cache_memory=memory) as engine:
        model = engine.runner.model
        layer = model.model.layers[0]
        assert isinstance(layer.mlp.down_proj, GGMLLinear) and isinstance(model.lm_head, GGMLLinear)
        assert (layer.mlp.down_proj.in_features, layer.self_attn.q_proj.out_features) == (512, 192)
        assert model.lm_head.out_features == 16384 and not any(p.numel() > 576 * 1536 for p in model.parameters())
        held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) - model.inv_freq.nbytes
        planned = weight_memory(resolve_model_arch("smollm2-135m"), tp=3, device="cpu").bytes_per_rank
        assert abs(held - planned) <= 0.001 * held, (held, planned)   # kv-estimate's figure for a rank
        got = step_logits(engine.runner)
        tokens = greedy(engine, prompts)
        info = engine.kv_cache_info()
    assert tokens == want
    for a, b in zip(ref, got):
        assert rel_err(a, b) <= 1e-4
    est = estimate(resolve_model_arch("smollm2-135m"), tensor_parallel_size=3, device="cpu", kv_cache_memory=memory,
                   max_model_len=64)
    assert (est.paged.num_blocks, est.paged.kv_cache_bytes) == (info.num_blocks, info.bytes_allocated)


def test_idle_workers_stay_and_a_killed_one_is_a_clear_error(tiny_factory, monkeypatch):
    t0 = time.monotonic()
    folder = tiny_factory(tokenizer=True, vocab_size=96)
    monkeypatch.setattr(defaults, "TP_TIMEOUT_S", 3.0)      # a worker gives up after 3 s without a step...
    monkeypatch.setattr(defaults, "TP_HEARTBEAT_S", 0.5)    # ...so rank 0 pings it while idle
    with tp_engine(folder, 2) as engine:
        assert greedy(engine, [[1, 2, 3]], max_tokens=2)
        time.sleep(4)
        engine.check_health()
        assert greedy(engine, [[1, 2, 3]], max_tokens=2)
        victim = engine.runner.workers[0]
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:     # the watchdog notices while the engine is idle
            try:
                engine.check_health()
            except EngineDeadError:
                break
            time.sleep(0.1)
        want = f"tensor-parallel worker rank 1 (pid {victim.pid}) exited with code -9"
        with pytest.raises(EngineDeadError, match=re.escape(want)):
            engine.check_health()
        engine.add_request("after", [4, 5, 6])
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            engine.step()
    assert time.monotonic() - t0 < 60
