"""kv-estimate against the engine: for a given KV-cache memory, the blocks the estimate predicts are
the blocks LLMEngine allocates, and its bytes are the nbytes of every KV tensor the engine allocated;
`kv-estimate --device cpu` (and its default flags on a CPU machine) resolves `auto` as the engine does."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from llmopt.cache.kivi import KiviConfig
from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.errors import UserInputError
from llmopt.estimate import estimate, resolve_model_arch
from llmopt.models.loader import load_model


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory(num_hidden_layers=3, intermediate_size=96, vocab_size=128, max_position_embeddings=256,
                        eos_token_id=1)


@pytest.fixture(scope="module")
def tiny_bf16(tiny_factory):
    """A bfloat16 checkpoint: `auto` runs it in float32 on the CPU, in bfloat16 on a GPU."""
    return tiny_factory(num_hidden_layers=3, intermediate_size=96, vocab_size=128, max_position_embeddings=256,
                        eos_token_id=1, dtype=torch.bfloat16)


def _engine(folder, dtype="auto", device="cpu", kv="auto", block_size=16, memory=1 << 20):
    loaded = load_model(str(folder), dtype, device, tokenizer=False)
    args = EngineArgs(model=str(folder), dtype=dtype, device=device, block_size=block_size, max_model_len=32,
                      kv_cache_memory=memory, kv_cache_dtype=kv, detokenize=False)
    return LLMEngine(args, loaded=loaded).kv_cache_info(), loaded


# engine (--dtype, kv_cache_dtype) -> the estimator's KV dtype (on the CPU bfloat16 names the weights:
# the model computes in float32, and its KV cache of auto is the weights' bfloat16)
CASES = [("float32", "auto", "float32"), ("bfloat16", "auto", "bfloat16"), ("float32", "bfloat16", "bfloat16"),
         ("float32", "float16", "float16"), ("float32", "fp8", "fp8"),
         ("float32", "fp8_e4m3", "fp8_e4m3"), ("float32", "fp8_e5m2", "fp8_e5m2"), ("float32", "int8", "int8")]


@pytest.mark.parametrize("dtype,engine_kv,est_kv", CASES)
@pytest.mark.parametrize("block_size,memory", [(16, (1 << 20) + 777), (8, 300_001)])
def test_engine_allocates_what_the_estimate_says(tiny, dtype, engine_kv, est_kv, block_size, memory):
    info, _ = _engine(tiny, dtype, "cpu", engine_kv, block_size, memory)
    est = estimate(resolve_model_arch(str(tiny)), kv_cache_dtype=est_kv, block_size=block_size,
                   kv_cache_memory=memory, max_model_len=32)
    assert est.paged.layout == "uniform"
    assert est.paged.num_blocks == info.num_blocks
    assert est.paged.block_bytes == info.num_layers * info.bytes_per_block
    assert est.paged.kv_cache_bytes == info.bytes_allocated


@pytest.mark.parametrize("block_size,memory", [(16, (1 << 20) + 777), (8, 300_001)])
def test_int4_cache_allocates_what_the_estimate_says(tiny_factory, block_size, memory):
    """int4: the engine's q4_0 rows (18 bytes per 32 values, no scale tensors) are kv-estimate's
    bytes; a head_dim that is not a multiple of 32 is refused by both with the same message."""
    folder = tiny_factory(num_hidden_layers=3, intermediate_size=96, vocab_size=128, max_position_embeddings=256,
                          eos_token_id=1, head_dim=32, hidden_size=128)
    info, _ = _engine(folder, "float32", "cpu", "int4", block_size, memory)
    est = estimate(resolve_model_arch(str(folder)), kv_cache_dtype="int4", block_size=block_size,
                   kv_cache_memory=memory, max_model_len=32)
    assert info.bytes_per_block == 2 * block_size * 2 * 18      # 2 kv heads of 32 values: one block each
    assert (est.paged.num_blocks, est.paged.block_bytes, est.paged.kv_cache_bytes) == \
        (info.num_blocks, info.num_layers * info.bytes_per_block, info.bytes_allocated)


@pytest.mark.parametrize("dtype,max_len,seqs,memory,kivi", [
    ("float32", 256, 256, 1 << 20, (32, 128)), ("bfloat16", 200, 4, 3_000_001, (32, 128)),
    ("float32", 100, 8, 2_000_003, (16, 32))])
def test_kivi2_allocates_what_the_estimate_says(tiny_factory, dtype, max_len, seqs, memory, kivi):
    """kivi2: the engine's two pools (quantized pages, full-precision residual) are kv-estimate's,
    block for block and byte for byte, the block size being KIVI's group size."""
    folder = tiny_factory(num_hidden_layers=3, intermediate_size=96, vocab_size=128, max_position_embeddings=256,
                          eos_token_id=1, head_dim=32, hidden_size=128)
    loaded = load_model(str(folder), dtype, "cpu", tokenizer=False)
    args = EngineArgs(model=str(folder), dtype=dtype, device="cpu", max_model_len=max_len, max_num_seqs=seqs,
                      kv_cache_memory=memory, kv_cache_dtype="kivi2", detokenize=False, max_num_batched_tokens=64,
                      kivi_group_size=kivi[0], kivi_residual_length=kivi[1])
    engine = LLMEngine(args, loaded=loaded)
    info = engine.kv_cache_info()
    est = estimate(resolve_model_arch(str(folder)), kv_cache_dtype="kivi2", kv_cache_memory=memory, device="cpu",
                   dtype=dtype, max_model_len=max_len, max_num_seqs=seqs, max_num_batched_tokens=64,
                   kivi=KiviConfig(*kivi))
    g, d, heads, layers = kivi[0], 32, 2, 3
    page = heads * ((4 * d + g * d // 4) + (4 * g * (d // min(g, d)) + g * d // 4))   # the layout, from its definition
    fp = 4 if dtype == "float32" else 2
    assert info.block_size == est.block_size == g
    assert info.bytes_per_block == page and est.paged.block_bytes == layers * page
    assert est.bytes_per_token == layers * page / g
    assert est.paged.residual_block_bytes == layers * info.residual_bytes_per_block == layers * 2 * g * heads * d * fp
    assert (est.paged.num_blocks, est.paged.residual_blocks) == (info.num_blocks, info.num_residual_blocks)
    assert est.paged.kv_cache_bytes == info.bytes_allocated
    assert est.paged.blocks_per_request == engine.blocks_per_request
    default = estimate(resolve_model_arch(str(folder)), kv_cache_dtype="kivi2", kv_cache_memory=memory, device="cpu",
                       dtype=dtype, max_model_len=max_len, max_num_seqs=seqs, kivi=KiviConfig(*kivi))
    assert default.max_num_batched_tokens == EngineArgs(device="cpu").max_num_batched_tokens   # the engine's default
    with pytest.raises(UserInputError, match="tensor-parallel-size 1"):
        estimate(resolve_model_arch(str(folder)), kv_cache_dtype="kivi2", tensor_parallel_size=2, gpu="H100")


def test_int4_refuses_a_head_dim_off_its_blocks(tiny):
    from llmopt.errors import UserInputError
    with pytest.raises(UserInputError, match="head_dim is 16") as engine_err:
        _engine(tiny, "float32", "cpu", "int4")
    with pytest.raises(UserInputError, match="head_dim is 16") as est_err:
        estimate(resolve_model_arch(str(tiny)), kv_cache_dtype="int4", max_model_len=32)
    assert str(engine_err.value) == str(est_err.value)


@pytest.fixture(scope="module")
def cli():
    from llmopt.cli.app import app
    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["kv-estimate", *args, "--json"])


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("flags", [["--device", "cpu"], ["--device", "cpu", "--dtype", "auto"],
                                   ["--device", "cpu", "--dtype", "bfloat16"], []])
def test_cli_device_and_dtype_resolve_auto_as_the_engine(tiny_bf16, cli, flags, kv):
    """The same flags to kv-estimate and to the engine give the same blocks for the same memory: on
    the CPU a bfloat16 checkpoint runs in float32 under auto (kv-estimate used to plan bfloat16).
    No flags at all: the engine's own defaults (auto device, auto dtype) on this machine."""
    memory = (1 << 20) + 12345
    r = cli("--model", str(tiny_bf16), "--kv-cache-memory", str(memory), "--max-model-len", "32",
            "--kv-cache-dtype", kv, *flags)
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    opts = dict(zip(flags[::2], flags[1::2]))
    info, loaded = _engine(tiny_bf16, opts.get("--dtype", "auto"), opts.get("--device", "auto"), kv, memory=memory)
    assert d["device"] == loaded.device.type and d["dtype"] == str(loaded.dtype).removeprefix("torch.")
    assert d["paged"]["num_blocks"] == info.num_blocks
    assert d["paged"]["kv_cache_bytes"] == info.bytes_allocated
    if not torch.cuda.is_available() and opts.get("--dtype", "auto") == "auto":
        assert d["dtype"] == "float32"


def test_gpu_plans_use_the_checkpoint_dtype(tiny_bf16):
    """--gpu / --gpu-memory plan for a GPU: auto is the checkpoint's dtype there (the engine's rule);
    on the CPU the model computes in float32 and its cache of auto stays the weights' bfloat16,
    float32 when the weights are widened."""
    arch = resolve_model_arch(str(tiny_bf16))
    est = estimate(arch, device="auto", gpu_memory_gib=1.0, kv_cache_memory=1 << 20)
    assert (est.device, est.dtype, est.kv_cache_dtype) == ("cuda", "bfloat16", "bfloat16")
    cpu = estimate(arch, device="cpu", kv_cache_memory=1 << 20)
    assert (cpu.dtype, cpu.weight_dtype, cpu.kv_cache_dtype) == ("float32", "bfloat16", "bfloat16")
    assert cpu.paged.num_blocks == est.paged.num_blocks
    wide = estimate(arch, device="cpu", dtype="float32", kv_cache_memory=1 << 20)
    assert (wide.dtype, wide.weight_dtype, wide.kv_cache_dtype) == ("float32", "float32", "float32")
    assert wide.paged.num_blocks == est.paged.num_blocks // 2


def test_only_float_checkpoints_plan_16bit_weights_on_the_cpu(tiny_bf16):
    """A quantized checkpoint's float tensors and a GGUF's follow the engine (not the checkpoint's
    16-bit dtype), so kv-estimate does not report 16-bit weights for them."""
    from dataclasses import replace
    arch = resolve_model_arch(str(tiny_bf16))
    assert estimate(arch, device="cpu", kv_cache_memory=1 << 20).weight_dtype == "bfloat16"
    awq = replace(arch, quantization_config={"quant_method": "awq", "bits": 4, "group_size": 32})
    assert estimate(awq, device="cpu", kv_cache_memory=1 << 20).weight_dtype == "float32"
    assert estimate(resolve_model_arch(None), device="cpu", kv_cache_memory=1 << 20).weight_dtype == "float32"
