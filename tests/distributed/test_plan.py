"""llmopt/distributed/plan.py, the one check of a tensor-parallel size: which sizes a model takes, the
messages, the per-rank split; the engine and kv-estimate refuse the same sizes with the same words."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llmopt.cli.app import app
from llmopt.distributed.plan import quant_group_size, tp_plan, valid_sizes
from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.errors import UserInputError
from llmopt.estimate import estimate, resolve_model_arch

SMOLLM2 = dict(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, vocab_size=49152)


def test_the_default_model_takes_1_and_3():
    assert valid_sizes(9, 3, 1536) == [1, 3]
    p = tp_plan(**SMOLLM2, world_size=3)
    assert (p.heads_per_rank, p.kv_heads_per_rank, p.kv_replicated, p.intermediate_per_rank, p.vocab_per_rank) == \
        (3, 1, False, 512, 16384)
    with pytest.raises(UserInputError, match=r"^--tensor-parallel-size 9 does not divide the MLP width 1,536 "
                                             r"\(valid sizes for this model: 1, 3\)$"):
        tp_plan(**SMOLLM2, world_size=9)
    with pytest.raises(UserInputError, match="does not divide the 9 attention heads"):
        tp_plan(**SMOLLM2, world_size=2)
    with pytest.raises(UserInputError, match="give at least 1"):
        tp_plan(**SMOLLM2, world_size=0)


def test_kv_heads_split_or_replicated():
    split = tp_plan(8, 4, 64, 100, 2)
    assert (split.kv_heads_per_rank, split.kv_replicated) == (2, False)
    assert [split.kv_head_start(r) for r in range(2)] == [0, 2]
    rep = tp_plan(8, 2, 64, 100, 8)        # 2 KV heads over 8 ranks: each held by 4 ranks
    assert (rep.kv_heads_per_rank, rep.kv_replicated) == (1, True)
    assert [rep.kv_head_start(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(UserInputError, match="the 6 KV heads do not divide one another"):
        tp_plan(12, 6, 48, 100, 4)


def test_vocab_padded_to_a_multiple_of_the_ranks():
    p = tp_plan(4, 2, 64, 97, 2)
    assert p.vocab_per_rank == 49 and [p.vocab_range(r) for r in range(2)] == [(0, 49), (49, 97)]


def test_quantization_groups_must_stay_whole():
    # MLP width 1,536 over 8 ranks: 192 inputs of down_proj per rank, not whole groups of 128
    assert valid_sizes(32, 8, 1536, group_size=128, head_dim=128) == [1, 2, 4]
    with pytest.raises(UserInputError, match="splits a quantization group.*group size 128"):
        tp_plan(32, 8, 1536, 1000, 8, group_size=128, head_dim=128)
    assert tp_plan(32, 8, 1536, 1000, 8, group_size=64, head_dim=128).intermediate_per_rank == 192
    assert quant_group_size({"quant_method": "awq", "group_size": 128}) == 128
    assert quant_group_size({"quant_method": "gptq", "group_size": -1}) is None
    ct = {"quant_method": "compressed-tensors",
          "config_groups": {"g": {"weights": {"strategy": "group", "group_size": 32}}}}
    assert quant_group_size(ct) == 32


@pytest.mark.parametrize("tp", [2, 9])
def test_engine_and_kv_estimate_refuse_the_same_sizes_in_the_same_words(tp):
    with pytest.raises(UserInputError) as engine_error:
        LLMEngine(EngineArgs(tensor_parallel_size=tp))     # refused before any process starts
    with pytest.raises(UserInputError) as estimate_error:
        estimate(resolve_model_arch("smollm2-135m"), tensor_parallel_size=tp, device="cpu")
    assert str(engine_error.value) == str(estimate_error.value)
    r = CliRunner().invoke(app, ["kv-estimate", "--tensor-parallel-size", str(tp), "--device", "cpu", "--json"])
    assert r.exit_code == 2
    assert json.loads(r.stdout)["error"]["message"] == str(engine_error.value)
    r = CliRunner().invoke(app, ["generate", "-tp", str(tp), "--json", "Hello"])    # the engine's flag
    assert r.exit_code == 2
    assert json.loads(r.stdout)["error"]["message"] == str(engine_error.value)


def test_kv_estimate_per_rank_kv_heads_come_from_the_plan():
    est = estimate(resolve_model_arch("smollm2-135m"), tensor_parallel_size=3, device="cpu", kv_cache_memory=1 << 20)
    assert est.kv_heads_per_rank == 1 and est.bytes_per_token * 3 == est.bytes_per_token_model
