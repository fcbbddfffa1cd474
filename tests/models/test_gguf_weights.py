"""GGUF files run as stored (llmopt.models.gguf_weights): a tiny llama GGUF of each block type the
CPU kernels multiply loads with no float copy of its weights and generates the same greedy tokens
as its dequantized float copy (written by `convert_gguf(weights=True)`, the gguf package's
dequantizers); other types come out dequantized with one log line; the cache holds no weights; the
default model loads with under 150 MB of weights and answers as its float copy does."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM, LlamaConfig

from engine_helpers import mixed_prompts
from gguf_util import write_tiny_gguf
from llmopt import defaults
from llmopt.kernels import cpu_quant
from llmopt.ggml_types import RUN_TYPES
from llmopt.layers.modules_ggml import GGMLEmbedding, GGMLLinear
from llmopt.models.gguf_convert import convert_gguf
from llmopt.models.loader import load_model

pytestmark = pytest.mark.skipif(cpu_quant.ops() is None, reason="needs the C++ kernels (g++, AVX2)")

# widths that every block type divides (K-quants: 256); 97 tokens: gguf_util's vocabulary
CFG = dict(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=64, max_position_embeddings=256, initializer_range=0.1,
           rms_norm_eps=1e-5, bos_token_id=95, eos_token_id=96)


def _gguf(tmp_path, monkeypatch, qtype: str | None, tied: bool = False):
    """A tiny GGUF of that type (its config and tokenizer then cached under tmp_path, not ~/.cache)."""
    monkeypatch.setattr(defaults, "CACHE_DIR", tmp_path / "cache")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**CFG, tie_word_embeddings=tied)).eval()
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_tiny_gguf(path, hf, qtype)
    return path


def _greedy(model: str | None, prompts, tokens: int = 12) -> list[list[int]]:
    from llmopt import LLM, SamplingParams
    llm = LLM(model=model, dtype="float32", device="cpu", kv_cache_memory=16 << 20, max_model_len=256)
    assert llm.engine.runner.cpu_decode is not None   # the C++ decode layers ran it
    assert llm.engine.runner.cpu_decode.int8_activations is defaults.CPU_DECODE_INT8_ACTIVATIONS
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("qtype", RUN_TYPES)
def test_each_block_type_runs_as_stored_and_matches_its_float_copy(tmp_path, qtype, monkeypatch):
    monkeypatch.setattr(defaults, "CPU_DECODE_INT8_ACTIVATIONS", False)   # float activations: exact
    path = _gguf(tmp_path, monkeypatch, qtype)
    lm = load_model(str(path), dtype="float32", device="cpu", tokenizer=False)
    m = lm.model
    linears = [mod for mod in m.modules() if isinstance(mod, (nn.Linear, GGMLLinear))]
    assert linears and all(type(mod) is GGMLLinear and mod.ggml_type == qtype for mod in linears)
    assert isinstance(m.model.embed_tokens, GGMLEmbedding) and lm.gguf == path
    assert not list(lm.path.glob("*.safetensors"))                            # the cache holds no weights
    # the weights held: the file's tensor bytes (codes at their bits, scales as stored; K-quants' 6-bit
    # sub-scales a byte each: 4 bytes a 256 more), as kv-estimate counts them
    import gguf
    from llmopt.estimate import resolve_model_arch
    from llmopt.estimate.weights import weight_memory
    held = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in [*m.parameters(), *m.buffers()]
                                                       if t is not m.inv_freq}.values())
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    assert held == weight_memory(resolve_model_arch(str(path)), device="cpu").bytes_total
    assert file_bytes <= held <= 1.03 * file_bytes, (held, file_bytes)
    float_copy = convert_gguf(path, tmp_path / "float", weights=True)
    ref = load_model(str(float_copy), dtype="float32", device="cpu", tokenizer=False).model
    for name, mod in m.named_modules():
        if isinstance(mod, GGMLLinear) and ".layers." in name:                 # each layer's weight, unfused
            assert torch.equal(mod.dequantized(), ref.get_submodule(name).weight)
    prompts = mixed_prompts(3, CFG["vocab_size"] - 2, lo=3, hi=20, seed=1)
    assert _greedy(str(path), prompts) == _greedy(str(float_copy), prompts)


def test_other_types_are_dequantized_with_one_log_line(tmp_path, monkeypatch, caplog):
    """An MXFP4 file (the gguf package quantizes every matrix to it): its Linears run as 4-bit float
    codes (GGUFMxfp4Linear) holding exactly the gguf package's dequantization; its token table, a
    type our kernels do not run as a table, comes out dequantized with one log line naming the type."""
    from llmopt.layers.modules_fp4 import GGUFMxfp4Linear
    path = _gguf(tmp_path, monkeypatch, "MXFP4")
    caplog.set_level(logging.INFO, logger="llmopt.models")
    m = load_model(str(path), dtype="float32", device="cpu", tokenizer=False).model
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(lines) == 1 and "MXFP4 (1 tensors)" in lines[0] and "Q4_K" in lines[0]   # the types that do run
    assert not [mod for mod in m.modules() if isinstance(mod, GGMLLinear)]
    assert type(m.model.embed_tokens) is nn.Embedding
    ref = load_model(str(convert_gguf(path, tmp_path / "float", weights=True)), dtype="float32", device="cpu",
                     tokenizer=False).model
    for name in ("model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj", "lm_head"):
        assert type(m.get_submodule(name)) is GGUFMxfp4Linear, name
        assert torch.equal(m.get_submodule(name).dequantized(), ref.get_submodule(name).weight), name
    assert torch.equal(m.model.embed_tokens.weight, ref.model.embed_tokens.weight)


def test_tied_table_is_one_table(tmp_path, monkeypatch):
    lm = load_model(str(_gguf(tmp_path, monkeypatch, "Q8_0", tied=True)), dtype="float32", device="cpu", tokenizer=False)
    m = lm.model
    assert type(m.lm_head) is GGMLLinear and m.model.embed_tokens.table[0] is m.lm_head
    assert not hasattr(m.model.embed_tokens, "own")   # the head owns the table: its bytes counted once


def test_the_default_model_runs_as_stored(smollm2_float, monkeypatch):
    """The built-in Q4_1 file: the weights held are the file's tensor bytes (its Q4_1 layers and Q8_0
    table repacked with their fp16 d and m as stored, nothing else; kv-estimate's figure), one table
    for the tied head and embedding, and the engine's greedy answers with float activations equal
    to those of its float copy."""
    import gguf
    monkeypatch.setattr(defaults, "CPU_DECODE_INT8_ACTIVATIONS", False)
    lm = load_model(None, tokenizer=False)
    m = lm.model
    held = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()]) - m.inv_freq.nbytes
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(lm.gguf)).tensors)
    assert held == file_bytes and held < 150e6
    from llmopt.estimate import resolve_model_arch
    from llmopt.estimate.weights import weight_memory
    assert weight_memory(resolve_model_arch(None), device="cpu").bytes_total == held   # kv-estimate's figure
    kinds = {mod.ggml_type for mod in m.modules() if isinstance(mod, GGMLLinear)}
    assert kinds == {"Q4_1", "Q8_0"} and not [mod for mod in m.modules() if type(mod) is nn.Linear]
    assert type(m.lm_head) is GGMLLinear and m.model.embed_tokens.table[0] is m.lm_head
    from llmopt.models.loader import load_tokenizer
    tok = load_tokenizer(smollm2_float)
    prompts = [tok(t).input_ids for t in ("The capital of France is", "def fibonacci(n):",
                                          "List three colors of the rainbow:")]
    assert _greedy(None, prompts, 24) == _greedy(str(smollm2_float), prompts, 24)


def test_the_default_model_perplexity_equals_its_float_copy(smollm2_float):
    """eval-ppl (--method llamacpp) on WikiText-2, as stored against the float copy: within 1%, with
    float activations (the dense path) and with the engine's default int8 activations (scored
    through its paged cache and C++ decode layers)."""
    from conftest import SHARED_DATA
    from llmopt.eval import load_text_dataset, plan_ppl, run_ppl
    wiki = load_text_dataset(str(SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"))
    got, kls = [], []
    for model, paged in ((None, None), (None, "float32"), (str(smollm2_float), None)):
        lm = load_model(model)
        r = run_ppl(lm, plan_ppl(lm.tokenizer, 2048, wiki, "llamacpp", limit=1024), batch_size=2,
                    kv_cache_dtype=paged, base=lm if paged else None)
        got.append(r.ppl)
        kls.append(r.kl)
    assert got[0] != got[1]                      # int8 activations ran: not the float path's figure
    assert abs(got[0] / got[2] - 1) <= 0.01 and abs(got[1] / got[2] - 1) <= 0.01
    # --base-model with a cache: the base scores through a float32 cache on the same path (int8
    # activations too), so a float32 cache has no KL divergence (the dense base would show ~0.002)
    assert kls[1].kld_mean == 0.0 and kls[1].top1_agreement == 1.0 and kls[1].base_ppl == got[1]


def llama_cpp_rope_factors(s: dict, head_dim: int, base: float = 10000.0) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py computes it for rope_type llama3 (in
    float64 here): 1 for short wavelengths, `factor` for long ones, a smooth ramp between."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old, lo, hi, factor = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"], s["factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_a_llama3_file_runs_its_rope_freqs_and_the_export_keeps_them(tmp_path, monkeypatch):
    """Llama 3.x GGUF files carry the llama3 RoPE scaling as rope_freqs.weight, one factor per
    frequency: the model's logits over 200 positions (past the scaling's original 64) equal
    transformers' with that rope_scaling, not the unscaled model's; `quantize --format gguf` from the
    file writes the same factors back, and from a Hugging Face llama3 folder the ones llama.cpp's
    converter would."""
    from llmopt.models.attention import DenseCausalAttention
    from llmopt.quant.config import QuantConfig
    from llmopt.quant.pipeline import quantize_model
    import gguf
    monkeypatch.setattr(defaults, "CACHE_DIR", tmp_path / "cache")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**CFG, rope_scaling=scaling)).eval()
    factors = llama_cpp_rope_factors(scaling, CFG["head_dim"])
    assert 1.0 < factors.max() and factors.min() == 1.0
    path = tmp_path / "llama3.gguf"
    write_tiny_gguf(path, hf, None, extra={"rope_freqs.weight": factors})
    lm = load_model(str(path), dtype="float32", device="cpu", tokenizer=False).model
    ids = torch.randint(0, 95, (1, 200), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(200)
    with torch.no_grad():
        got = lm.compute_logits(lm(ids, pos, DenseCausalAttention()))[0]
        want = hf(ids).logits[0]
        plain = AutoModelForCausalLM.from_config(LlamaConfig(**CFG)).eval()
        plain.load_state_dict(hf.state_dict())
        unscaled = plain(ids).logits[0]
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), float((got - want).abs().max())
    assert float((got - unscaled).abs().max()) > 1e-2
    out = tmp_path / "export.gguf"
    quantize_model(str(path), out, QuantConfig(method="rtn", format="gguf", group_size=32, seq_len=128))
    t = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}["rope_freqs.weight"]
    assert t.tensor_type.name == "F32" and np.allclose(np.asarray(t.data), factors, rtol=1e-6)
    folder = tmp_path / "hf-llama3"
    hf.save_pretrained(folder)
    from llmopt.quant.formats.gguf import rope_freq_factors
    from llmopt.models.config import ModelConfig
    assert np.allclose(rope_freq_factors(ModelConfig.from_path(folder)), factors, rtol=1e-6)


@pytest.mark.parametrize("qtype,tied", [("F16", False), ("BF16", True)])
def test_16bit_matrices_run_as_stored(tmp_path, monkeypatch, qtype, tied):
    """An F16 / BF16 GGUF holds its matrices 16-bit (the file's bytes, which kv-estimate counts),
    whatever --dtype, and generates exactly as its dequantized float32 copy."""
    from llmopt.estimate.weights import weight_memory
    from llmopt.estimate import resolve_model_arch
    from llmopt.layers.modules16 import Embedding16, Linear16
    monkeypatch.setattr(defaults, "CPU_DECODE_INT8_ACTIVATIONS", False)   # (no integer linears: either way)
    path = _gguf(tmp_path, monkeypatch, qtype, tied=tied)
    dt = {"F16": torch.float16, "BF16": torch.bfloat16}[qtype]
    m = load_model(str(path), dtype="float32", device="cpu", tokenizer=False).model
    linears = [mod for mod in m.modules() if isinstance(mod, nn.Linear)]
    assert linears and all(type(mod) is Linear16 and mod.weight.dtype == dt for mod in linears)
    assert type(m.model.embed_tokens) is Embedding16 and (m.lm_head.weight is m.model.embed_tokens.weight) == tied
    held = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in [*m.parameters(), *m.buffers()]
                                                       if t is not m.inv_freq}.values())
    assert held == weight_memory(resolve_model_arch(str(path)), device="cpu").bytes_total
    float_copy = convert_gguf(path, tmp_path / "float", weights=True)
    prompts = mixed_prompts(3, CFG["vocab_size"] - 2, lo=3, hi=20, seed=1)
    assert _greedy(str(path), prompts) == _greedy(str(float_copy), prompts)
