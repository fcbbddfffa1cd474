"""kv-estimate against the engine: for a given KV-cache memory, the blocks the estimate predicts are
the blocks LLMEngine allocates, and its bytes are the nbytes of every KV tensor the engine allocated."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.estimate import estimate, resolve_model_spec
from llmopt.models.loader import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=96, vocab_size=128, max_position_embeddings=256, eos_token_id=1)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


# engine (model dtype, kv_cache_dtype) -> the estimator's KV dtype
CASES = [("float32", "auto", "float32"), ("bfloat16", "auto", "bfloat16"), ("float32", "fp8", "fp8"),
         ("float32", "fp8_e4m3", "fp8_e4m3"), ("float32", "fp8_e5m2", "fp8_e5m2"), ("float32", "int8", "int8")]


@pytest.mark.parametrize("dtype,engine_kv,est_kv", CASES)
@pytest.mark.parametrize("block_size,memory", [(16, (1 << 20) + 777), (8, 300_001)])
def test_engine_allocates_what_the_estimate_says(tiny, dtype, engine_kv, est_kv, block_size, memory):
    loaded = load_model(str(tiny), dtype, "cpu", tokenizer=False)
    args = EngineArgs(model=str(tiny), dtype=dtype, device="cpu", block_size=block_size, max_model_len=32,
                      kv_cache_memory=memory, kv_cache_dtype=engine_kv, detokenize=False)
    info = LLMEngine(args, loaded=loaded).kv_cache_info()
    est = estimate(resolve_model_spec(str(tiny)), kv_cache_dtype=est_kv, block_size=block_size,
                   kv_cache_memory=memory, max_model_len=32)
    assert est.paged.layout == "uniform"
    assert est.paged.num_blocks == info.num_blocks
    assert est.paged.block_bytes == info.num_layers * info.bytes_per_block
    assert est.paged.kv_cache_bytes == info.bytes_allocated
