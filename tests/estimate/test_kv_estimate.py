"""kv-estimate: golden bytes per token, vLLM's block accounting (single-type and Gemma-2/3 hybrid),
KV dtypes with their scales, weight memory against transformers' own parameter counts, model
sources (presets, folders, GGUF, the HF cache), and the CLI (--json, --require-fit, bad input)."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from llmopt.errors import ModelLoadError, UserInputError
from llmopt.estimate import build_layout, bytes_per_token, estimate, layer_kv_specs, resolve_model_arch, weight_memory
from llmopt.estimate.kv import LayerKV
from llmopt.estimate.arch import arch_from_config
from llmopt.estimate.params import count_params
from llmopt.estimate.tensors import read_gguf

GIB = 1 << 30


def cdiv(a, b):
    return -(-a // b)


# --- golden values -------------------------------------------------------------------------------

@pytest.mark.parametrize("model,expected", [
    ("meta-llama/Llama-3.1-8B", 131_072), ("meta-llama/Llama-3.1-70B", 327_680), ("Qwen/Qwen2.5-7B", 57_344),
    ("deepseek-ai/DeepSeek-V3", 61 * 576 * 2), ("mistralai/Mistral-7B-v0.1", 131_072),
    ("llama-3.1-70b", 327_680), ("qwen2.5-7b", 57_344)])
def test_golden_bytes_per_token_bf16(model, expected):
    assert bytes_per_token(resolve_model_arch(model), "bf16") == expected


def test_seed_7b_mha_example_is_one_gib_for_2048_tokens_at_fp16():
    arch = resolve_model_arch("meta-llama/Llama-2-7b-hf")
    assert arch.attention == "MHA"
    assert bytes_per_token(arch, "fp16") * 2048 == GIB
    est = estimate(arch, kv_cache_dtype="fp16", max_model_len=2048, naive=True)
    assert est.request_bytes == GIB and est.naive.naive_bytes == GIB and est.naive.ratio == 1.0


def test_mistral_window_caps_blocks_per_request_as_vllm():
    arch = resolve_model_arch("mistral-7b-v0.1")
    layers = layer_kv_specs(arch, "bf16")
    assert {x.window for x in layers} == {4096}
    layout = build_layout(layers, 16)
    assert layout.mode == "uniform" and len(layout.groups) == 1
    for max_len, mnbt in ((32768, 2048), (32768, 8192), (3000, 2048), (100_000, 512)):
        # vLLM SlidingWindowSpec.max_memory_usage_bytes: cdiv(min(window - 1 + mnbt, max_model_len), bs) + 1 pages
        assert layout.blocks_per_request(max_len, mnbt) == cdiv(min(4096 - 1 + mnbt, max_len), 16) + 1
    est = estimate(arch, kv_cache_memory=8 * GIB, max_model_len=32768)
    assert est.paged.blocks_per_request == 385
    assert est.paged.longest_context_limited_by == "model"   # a window never outgrows the cache
    assert est.request_bytes == 385 * 16 * 131_072


def test_tensor_parallel_splits_and_replicates_kv_heads():
    arch = resolve_model_arch("llama-3.1-70b")
    assert bytes_per_token(arch, "bf16", tp=2) == 327_680 // 2
    assert bytes_per_token(arch, "bf16", tp=16) == 2 * 80 * 1 * 128 * 2     # 8 heads over 16 ranks: one each
    assert bytes_per_token(resolve_model_arch("deepseek-v3"), "bf16", tp=8) == 61 * 576 * 2   # MLA latent replicated
    with pytest.raises(UserInputError):
        estimate(arch, tensor_parallel_size=3)


# --- KV dtypes -----------------------------------------------------------------------------------

def test_kv_dtypes_and_their_scales():
    arch = resolve_model_arch("llama-3.1-8b")      # 32 layers, 8 KV heads, head_dim 128
    L, H, D = 32, 8, 128
    assert bytes_per_token(arch, "float32") == 2 * L * H * D * 4
    assert bytes_per_token(arch, "auto") == 2 * L * H * D * 2                 # bf16 checkpoint
    for fp8 in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert bytes_per_token(arch, fp8) == 2 * L * H * D                    # per-tensor scales: no per-token bytes
    assert bytes_per_token(arch, "int8") == L * (2 * H * D + 2 * H * 4)       # + float32 scale per token and head, K and V
    assert bytes_per_token(arch, "int4") == L * 2 * H * (D // 32) * 18        # q4_0: 18 bytes per 32 values
    # KIVI-2: 2-bit codes; keys per channel over 32 tokens, values per token over 32 channels; fp16 scale + zero
    per_head = Fraction(2 * D * 2, 8) + Fraction(2 * D * 2, 32) + 2 * (D // 32) * 2
    assert bytes_per_token(arch, "kivi2") == L * H * per_head == 24_576
    est = estimate(arch, kv_cache_dtype="kivi2", kv_cache_memory=4 * GIB, max_model_len=4096)
    # a block is one group of 32 tokens: the groups before the last 128 tokens quantized, those at bf16
    assert est.block_size == 32 and est.paged.block_bytes == 32 * 24_576
    assert est.paged.blocks_per_request == (4096 - 128) // 32
    assert est.paged.residual_blocks_per_request == 128 // 32 + 1     # R..R+G tokens between conversions
    assert est.paged.residual_block_bytes == 32 * 2 * D * 2 * H * L
    assert est.request_bytes == 124 * 32 * 24_576 + 5 * 32 * 2 * D * 2 * H * L
    with pytest.raises(UserInputError):
        bytes_per_token(arch, "int3")
    with pytest.raises(UserInputError):
        bytes_per_token(resolve_model_arch("deepseek-v3"), "kivi2")
    assert bytes_per_token(resolve_model_arch("deepseek-v3"), "fp8_ds_mla") == 61 * 656


# --- vLLM's block computation --------------------------------------------------------------------

@pytest.mark.parametrize("model,dtype,tp", [("llama-3.1-8b", "bf16", 1), ("llama-3.1-70b", "fp8", 2),
                                            ("qwen2.5-7b", "int8", 1), ("deepseek-v3", "bf16", 8)])
def test_single_type_blocks_match_vllm(model, dtype, tp):
    arch = resolve_model_arch(model)
    available = 37 * GIB + 12345
    est = estimate(arch, kv_cache_dtype=dtype, tensor_parallel_size=tp, kv_cache_memory=available, max_model_len=8192)
    bpt = bytes_per_token(arch, dtype, tp)
    page = 16 * bpt // arch.num_layers                                  # one layer's block (vLLM page_size_bytes)
    assert est.paged.layout == "uniform"
    assert est.paged.block_bytes == 16 * bpt                            # block_size x bytes per token of all layers
    assert est.paged.num_blocks == available // (16 * bpt) == available // page // arch.num_layers
    assert est.paged.blocks_per_request == 8192 // 16
    assert est.paged.max_concurrency == est.paged.num_blocks / 512
    assert est.paged.tokens == est.paged.num_blocks * 16
    # estimate_max_model_len: the largest L with cdiv(L, 16) blocks <= num_blocks
    assert est.paged.longest_context == min(est.paged.num_blocks * 16, arch.max_position_embeddings)


def test_gemma2_hybrid_groups_and_blocks_match_vllm():
    arch = resolve_model_arch("google/gemma-2-9b-it")     # 42 layers alternating window 4096 / global
    layers = layer_kv_specs(arch, "bf16")
    assert [x.window for x in layers[:4]] == [4096, None, 4096, None]
    layout = build_layout(layers, 16)
    page = 2 * 16 * 8 * 256 * 2
    # 21 sliding + 21 full: group size 21, two groups, one pool of blocks of 21 pages
    assert layout.mode == "hybrid" and sorted(len(g.layers) for g in layout.groups) == [21, 21]
    assert layout.block_bytes == page * 21 and layout.padding_layers == 0
    available = 20 * GIB + 999
    est = estimate(arch, kv_cache_memory=available, max_model_len=8192, max_num_batched_tokens=2048)
    assert est.paged.num_blocks == available // page // 21
    assert est.paged.blocks_per_request == cdiv(8192, 16) + cdiv(min(4095 + 2048, 8192), 16) + 1
    assert est.paged.tokens == est.paged.num_blocks // 2 * 16
    off = build_layout(layers, 16, hybrid=False)         # --disable-hybrid-kv-cache-manager: full blocks everywhere
    assert off.mode == "uniform" and off.blocks_per_request(8192, 2048) == 512


def test_gemma3_hybrid_padding_matches_vllm():
    arch = resolve_model_arch("gemma-3-27b")              # 62 layers: 52 sliding (1024) + 10 global
    layers = layer_kv_specs(arch, "bf16")
    assert sum(x.window is None for x in layers) == 10 and layers[5].window is None and layers[0].window == 1024
    layout = build_layout(layers, 16)
    # group size = 10 (52 >= 1.5 x 10): sliding layers split into cdiv(52, 10) = 6 groups, 8 padding slots
    sizes = sorted(len(g.layers) for g in layout.groups)
    assert sizes == [8, 8, 9, 9, 9, 9, 10] and layout.padding_layers == 8 and layout.group_size == 10
    page = 2 * 16 * 16 * 128 * 2
    available = 30 * GIB
    est = estimate(arch, kv_cache_memory=available, max_model_len=32768, max_num_batched_tokens=2048)
    assert est.paged.num_blocks == available // page // 10
    assert est.paged.blocks_per_request == 2048 + 6 * (cdiv(1023 + 2048, 16) + 1)


def test_uniform_type_and_page_unification():
    full = [LayerKV(i, "full", None, h, 64, Fraction(2 * h * 64 * 2)) for i, h in enumerate((4, 8, 4))]
    layout = build_layout(full, 16)                  # same type, different page sizes: one group, summed pages
    assert layout.mode == "uniform-type" and layout.block_bytes == 16 * 2 * 64 * 2 * 16
    mixed = [LayerKV(0, "full", None, 8, 64, Fraction(2 * 8 * 64 * 2)),
             LayerKV(1, "sliding", 128, 4, 64, Fraction(2 * 4 * 64 * 2))]
    layout = build_layout(mixed, 16)                 # smaller page: block size doubled to unify pages
    assert layout.mode == "hybrid" and {g.kind: g.block_size for g in layout.groups} == {"full": 16, "sliding": 32}


def test_memory_budget_and_require_fit_semantics():
    arch = resolve_model_arch("meta-llama/Llama-3.1-70B")
    est = estimate(arch, gpu="H200", tensor_parallel_size=2, kv_cache_dtype="fp8", max_model_len=32768)
    m = est.memory
    assert m.gpu_memory_bytes == 143_771 << 20 and m.budget_bytes == int((143_771 << 20) * 0.9)
    assert m.weights_bytes == est.weights.bytes_total // 2 + 161 * 8192 * 2 // 2   # norms on both ranks
    assert m.kv_available_bytes == m.budget_bytes - m.weights_bytes - m.reserve_bytes
    assert est.paged.num_blocks == m.kv_available_bytes // (16 * 163_840 // 2)
    assert est.fits and est.paged.max_concurrency > 20
    big = estimate(arch, gpu="RTX-4090")
    assert big.fits is False and "exceed the budget" in big.problems[0]
    g = estimate(arch, gpu="H200", tensor_parallel_size=2, batch_sizes=[1, 64], seq_lens=[2048, 131072])
    cells = {(c.batch_size, c.seq_len): c.fits for c in g.grid}
    assert cells[(1, 2048)] and not cells[(64, 131072)] and g.fits is False


# --- weights -------------------------------------------------------------------------------------

_TINY = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             vocab_size=128, head_dim=16, max_position_embeddings=256)


@pytest.mark.parametrize("model_type,extra", [
    ("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("qwen3", {}),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}), ("gemma2", {"sliding_window": 32}),
    ("gemma3_text", {"sliding_window": 32, "num_hidden_layers": 7}),
    ("deepseek_v3", {"kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                     "v_head_dim": 16, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 24, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
])
def test_parameter_count_matches_transformers(model_type, extra):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(model_type, **{**_TINY, **extra})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    ref = sum(p.numel() for p in model.parameters())           # shared (tied) tensors counted once
    ref += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))  # in checkpoints
    arch = arch_from_config(cfg.to_dict(), model_type, "config", "test")
    assert count_params(arch) == ref
    if extra.get("sliding_window"):
        assert [x.window for x in layer_kv_specs(arch, "bf16")] == [
            32 if t == "sliding_attention" else None for t in cfg.layer_types]


def test_published_parameter_counts_and_formats():
    arch = resolve_model_arch("llama-3.1-8b")
    assert count_params(arch) == 8_030_261_248                    # model.safetensors.index.json total_size / 2
    assert weight_memory(arch, "bf16").bytes_total == 16_060_522_496
    # int4 g128 (AutoAWQ GEMM): qweight [in, out/8] int32, qzeros [in/g, out/8] int32, scales [in/g, out] fp16
    def awq(out, inp, g=128):
        return sum(torch.empty(s, dtype=d).nbytes for s, d in (((inp, out // 8), torch.int32),
                                                               ((inp // g, out // 8), torch.int32),
                                                               ((inp // g, out), torch.float16)))
    h, kv, inter = 4096, 1024, 14336
    linear = 32 * (2 * awq(h, h) + 2 * awq(kv, h) + 2 * awq(inter, h) + awq(h, inter))
    rest = (2 * 128256 * h + 65 * h) * 2                          # embeddings, head, norms stay bf16
    assert weight_memory(arch, "int4").bytes_total == linear + rest
    assert weight_memory(resolve_model_arch("smollm2-1.7b"), "bf16").params == 1_711_376_384   # tied: counted once
    tp = weight_memory(resolve_model_arch("llama-3.1-70b"), "bf16", tp=4)
    assert tp.bytes_per_rank == tp.bytes_total // 4 + 3 * (161 * 8192 * 2) // 4    # norms replicated on every rank
    with pytest.raises(UserInputError):
        weight_memory(arch, "int5")


def test_gguf_header_and_weights_against_gguf_reader(tmp_path):
    import gguf
    from gguf.quants import quantize
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_context_length(512)
    w.add_token_list([f"t{i}" for i in range(32)])
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", quantize(rng.standard_normal((32, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((64, 64)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta, tensors = read_gguf(path)
    ref = gguf.GGUFReader(str(path))
    assert [(t.name, t.nbytes) for t in tensors] == [(t.name, int(t.n_bytes)) for t in ref.tensors]
    assert tensors[0].shape == (32, 64) and tensors[0].dtype == "Q8_0"
    arch = resolve_model_arch(str(path))
    assert (arch.num_layers, arch.num_kv_heads, arch.head_dim, arch.vocab_size) == (2, 2, 16, 32)
    assert arch.tie_word_embeddings and arch.serving_dtype == "float32"
    # on a GPU, as the Triton kernels hold it: Q8_0 as 8-bit codes with a float32 scale and zero point
    # per 32, the rest in the model's dtype (float32 here); on the CPU the file's bytes for Q8_0 (d as
    # stored), the F16 matrix as stored, the norm float32
    assert weight_memory(arch, device="cuda").bytes_total == 32 * 64 + 32 * 2 * 8 + 64 * 4 + 64 * 64 * 4
    assert weight_memory(arch, device="cpu").bytes_total == sum(int(t.n_bytes) for t in ref.tensors)


def test_gguf_mla_metadata(tmp_path):
    import gguf
    path = tmp_path / "mla.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek2")
    for key, v in {"block_count": 61, "embedding_length": 7168, "attention.head_count": 128,
                   "attention.head_count_kv": 128, "attention.kv_lora_rank": 512, "attention.q_lora_rank": 1536,
                   "rope.dimension_count": 64, "attention.key_length": 192, "attention.value_length": 128,
                   "vocab_size": 129280, "feed_forward_length": 18432, "expert_count": 256, "expert_shared_count": 1,
                   "expert_used_count": 8, "expert_feed_forward_length": 2048, "leading_dense_block_count": 3,
                   "context_length": 163840}.items():
        w.add_uint32(f"deepseek2.{key}", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    arch = resolve_model_arch(str(path))
    assert arch.attention == "MLA" and bytes_per_token(arch, "bf16") == 61 * 576 * 2
    assert count_params(arch) == count_params(resolve_model_arch("deepseek-v3"))


def test_default_model_gguf_spec():
    arch = resolve_model_arch(None)            # SmolLM2-135M GGUF: read from the header only
    assert (arch.num_layers, arch.hidden_size, arch.num_kv_heads, arch.head_dim, arch.vocab_size) == (30, 576, 3, 64, 49152)
    assert bytes_per_token(arch, "fp16") == 2 * 30 * 3 * 64 * 2
    wm = weight_memory(arch)
    assert wm.source == "file" and wm.params == 134_515_008


# --- model sources -------------------------------------------------------------------------------

def test_folder_hf_cache_and_overrides(tmp_path, monkeypatch):
    from conftest import make_tiny
    from transformers import AutoModelForCausalLM
    make_tiny(tmp_path / "tiny", **_TINY, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    arch = resolve_model_arch(str(tmp_path / "tiny"))
    assert arch.source == "config" and arch.tensors
    ref = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_memory(arch).bytes_total == ref and weight_memory(arch).source == "file"

    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text((tmp_path / "tiny" / "config.json").read_text())
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    cached = resolve_model_arch("acme/tiny")
    assert cached.source == "hf-cache" and cached.num_layers == 4

    sparse = tmp_path / "gemma3"          # a config.json with only non-default values: transformers fills the rest
    sparse.mkdir()
    (sparse / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "num_hidden_layers": 12, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 32}}))
    from transformers import Gemma3TextConfig
    g = resolve_model_arch(str(sparse))
    assert g.vocab_size == Gemma3TextConfig().vocab_size and [x.window for x in layer_kv_specs(g, "bf16")][4:7] == [32, None, 32]

    o = resolve_model_arch("llama-3.1-8b", {"num_layers": 16, "num_kv_heads": 4, "sliding_window": 1024})
    assert o.num_layers == 16 and bytes_per_token(o, "bf16") == 2 * 16 * 4 * 128 * 2
    assert set(x.window for x in layer_kv_specs(o, "bf16")) == {1024}      # no sliding layers: every layer
    g2 = resolve_model_arch("gemma-2-9b", {"sliding_window": 512})          # sliding layers only
    assert g2.layer_windows[:4] == [512, None, 512, None]
    assert set(resolve_model_arch("mistral-7b-v0.1", {"sliding_window": 0}).layer_windows) == {None}
    # a llama config.json with a stray window: transformers' Llama (and the engine) attend fully
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "config.json").write_text(json.dumps({**json.loads((tmp_path / "tiny" / "config.json").read_text()),
                                                   "sliding_window": 8}))
    assert resolve_model_arch(str(stray)).layer_windows == [None] * 4
    mqa = resolve_model_arch("llama-3.1-8b", {"num_kv_heads": 1})
    assert mqa.attention == "MQA" and bytes_per_token(mqa, "bf16") == 2 * 32 * 1 * 128 * 2
    with pytest.raises(UserInputError):
        resolve_model_arch("llama-3.1-8b", {"num_kv_heads": 0})
    with pytest.raises(ModelLoadError):
        resolve_model_arch("no-such/model-anywhere")


# --- CLI -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli():
    from llmopt.cli.app import app
    import llmopt.cli.kv_estimate  # noqa: F401 - registers the command

    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["kv-estimate", *args])


def test_cli_done_when_command_prints_breakdown(cli):
    r = cli("--model", "meta-llama/Llama-3.1-70B", "--gpu", "H200", "--tensor-parallel-size", "2",
            "--kv-cache-dtype", "fp8", "--max-model-len", "32768")
    assert r.exit_code == 0, r.output
    for word in ("weights", "KV cache", "reserve", "blocks", "max concurrency", "fits"):
        assert word in r.output


def test_cli_json_grid_and_naive(cli):
    r = cli("--model", "qwen2.5-7b", "--gpu", "A100-40GB", "--batch-sizes", "1,8,32", "--seq-lens", "2k,32k",
            "--naive", "--json", "--max-model-len", "32k")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["bytes_per_token"] == 57_344 and d["max_model_len"] == 32768
    assert {(c["batch_size"], c["seq_len"]) for c in d["grid"]} == {(b, s) for b in (1, 8, 32) for s in (2048, 32768)}
    assert d["naive"]["naive_bytes"] == 2 * 28 * 3584 * 32768 * 2 and d["paged"]["num_blocks"] > 0


def test_cli_require_fit_exit_code_3(cli):
    r = cli("--model", "llama-3.1-70b", "--gpu", "RTX-4090", "--require-fit", "--json")
    assert r.exit_code == 3
    assert json.loads(r.stdout)["fits"] is False
    ok = cli("--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--max-model-len", "8k", "--require-fit")
    assert ok.exit_code == 0, ok.output


@pytest.mark.parametrize("args", [["--max-model-len", "abc"], ["--kv-cache-dtype", "fp3"], ["--gpu", "TPU-v9"],
                                  ["--model", "nope/nothing"], ["--seq-lens", "2k,,x"], ["--block-size", "0"]])
def test_cli_bad_input_is_one_line_exit_2(cli, args):
    r = cli("--model", "llama-3.1-8b", *args) if args[0] != "--model" else cli(*args)
    assert r.exit_code == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:")


def test_cli_list_presets(cli):
    r = cli("--list-presets", "--json")
    assert r.exit_code == 0
    d = json.loads(r.stdout)
    ids = {m["hf_id"] for m in d["models"]}
    for need in ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B",
                 "mistralai/Mistral-7B-v0.1", "mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen2.5-7B", "Qwen/Qwen3-8B",
                 "deepseek-ai/DeepSeek-V3", "google/gemma-2-9b-it", "HuggingFaceTB/SmolLM2-135M",
                 "HuggingFaceTB/SmolLM2-1.7B"):
        assert need in ids
    assert all(m["source"].startswith("https://") for m in d["models"])
    assert {"H100-80GB", "H200", "A100-40GB", "A100-80GB", "RTX-4090", "L40S"} <= {g["name"] for g in d["gpus"]}


def test_what_if_levers_rerun_the_plan():
    arch = resolve_model_arch("llama-3.1-70b")
    est = estimate(arch, gpu="A100-80GB", max_model_len=131072, what_if=True)
    rows = {w.change: w for w in est.what_if}
    assert est.fits is False and rows["--tensor-parallel-size 4"].fits
    tp4 = estimate(arch, gpu="A100-80GB", max_model_len=131072, tensor_parallel_size=4)
    assert rows["--tensor-parallel-size 4"].max_concurrency == tp4.paged.max_concurrency
    assert rows["--weight-format int4"].weights_per_gpu_bytes == weight_memory(arch, "int4").bytes_total
    assert "--kv-cache-dtype fp8" in rows and estimate(arch, gpu="A100-80GB").what_if == []
