"""Our Llama-family runtime against transformers' own modeling code, logits in float32.

Tiny random models come from conftest's make_tiny (transformers' own model classes, saved with
save_pretrained) and are loaded back through llmopt's loader and by transformers as the reference, so the
test covers config parsing and weight loading too.
Weights use a large initializer_range so attention is sharp: a wrong RoPE, mask or norm then
moves the logits far beyond the tolerance (each test also checks it can tell a broken variant).
"""

from __future__ import annotations

import torch
from conftest import make_tiny
from transformers import AutoModelForCausalLM

from llmopt.models.attention import DenseCausalAttention
from llmopt.models.loader import load_model

TOL = 1e-4
BASE = dict(vocab_size=97, intermediate_size=112, max_position_embeddings=256, initializer_range=0.25,
            rms_norm_eps=1e-6)     # on top of conftest.TINY (GQA 4/2, head_dim 16, two layers)


def _pair(path, model_type, **over):
    make_tiny(path, model_type, **{**BASE, **over})
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    ours = load_model(str(path), dtype="float32", device="cpu", tokenizer=False)
    return hf, ours


def _ours_logits(lm, ids):
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return lm.model.compute_logits(lm.model(ids, pos, DenseCausalAttention()))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _check(path, model_type="llama", seq=24, batch=2, **over):
    hf, lm = _pair(path, model_type, **over)
    ids = torch.randint(0, hf.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = _ours_logits(lm, ids)
    assert ours.shape == ref.shape
    assert _rel(ours, ref) <= TOL, _rel(ours, ref)
    return hf, lm, ids, ref


def test_llama_gqa(tmp_path):
    hf, lm, ids, ref = _check(tmp_path)
    assert lm.config.num_key_value_heads == 2
    # sensitivity: RoPE is relative, so stretched positions (2i) must move the logits past the tolerance
    pos = (2 * torch.arange(ids.shape[1])).expand_as(ids)
    with torch.no_grad():
        shifted = lm.model.compute_logits(lm.model(ids, pos, DenseCausalAttention()))
    assert _rel(shifted, ref) > 100 * TOL


def test_llama_mqa_tied_embeddings(tmp_path):
    hf, lm, *_ = _check(tmp_path, num_key_value_heads=1, tie_word_embeddings=True)
    assert lm.config.tie_word_embeddings and lm.model.lm_head.weight is lm.model.model.embed_tokens.weight


def test_llama_mha(tmp_path):
    _check(tmp_path, num_key_value_heads=4)


def test_llama3_rope_scaling_and_attention_bias(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    hf, lm, ids, ref = _check(tmp_path, seq=40, rope_parameters=rope, attention_bias=True, mlp_bias=True)
    assert lm.config.rope_scaling["rope_type"] == "llama3" and lm.config.o_bias and lm.config.mlp_bias
    # sensitivity: the same weights with unscaled RoPE give logits past the tolerance
    from llmopt.models.llama import rope_inv_freq
    lm.model.inv_freq = rope_inv_freq(type(lm.config)(**{**lm.config.to_dict(), "rope_scaling": None}))
    assert _rel(_ours_logits(lm, ids), ref) > 100 * TOL


def test_mistral_sliding_window_past_the_window(tmp_path):
    hf, lm, ids, ref = _check(tmp_path, "mistral", seq=30, sliding_window=8)
    assert lm.config.layer_windows == [8, 8]
    # sensitivity: without the window (full causal attention) logits past position 8 differ
    for layer in lm.model.model.layers:
        layer.self_attn.window = None
    full = _ours_logits(lm, ids)
    assert _rel(full[:, :8], ref[:, :8]) <= TOL
    assert _rel(full, ref) > 100 * TOL


def test_qwen2_qkv_bias(tmp_path):
    hf, lm, *_ = _check(tmp_path, "qwen2")
    assert lm.config.qkv_bias and not lm.config.o_bias
    assert lm.model.model.layers[0].self_attn.q_proj.bias is not None


def test_qwen3_qk_norm(tmp_path):
    hf, lm, *_ = _check(tmp_path, "qwen3")
    assert lm.config.qk_norm
    assert lm.model.model.layers[0].self_attn.q_norm is not None


def _suffix_logits(lm, ids, s):
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return lm.model.compute_logits(lm.model(ids, pos, DenseCausalAttention(), suffix_from=s))


def test_suffix_only_last_layer_matches_transformers(tmp_path):
    """suffix_from: the last layer runs its queries/MLP for the suffix only (eval-ppl's sliding windows);
    the rows must be transformers' rows, inside and past a sliding window, with q/k/v bias too."""
    for model_type, over in (("mistral", {"sliding_window": 8}), ("qwen2", {})):
        hf, lm, ids, ref = _check(tmp_path / model_type, model_type, seq=30, **over)
        for s in (1, 9, 29):
            ours = _suffix_logits(lm, ids, s)
            assert ours.shape == ref[:, s:].shape
            assert _rel(ours, ref[:, s:]) <= TOL, (model_type, s)


def test_fused_qkv_follows_its_projections(tmp_path):
    """Loading fuses q/k/v into one GEMM over views; replacing a projection's weight (as a quantizer
    or a reload does) must fall back to the three projections, never use the stale fused copy."""
    hf, lm, ids, ref = _check(tmp_path)
    at = lm.model.model.layers[0].self_attn
    assert at._qkv is not None and at._qkv.run[0].data_ptr() == at.q_proj.weight.data_ptr()
    seen = []
    h = at.k_proj.register_forward_pre_hook(lambda _m, a: seen.append(a[0].shape))
    assert _rel(_ours_logits(lm, ids), ref) <= TOL
    h.remove()
    assert len(seen) == 1          # a hooked projection is called (as calibration hooks expect)
    new = torch.nn.Parameter(at.q_proj.weight.detach() * 1.5, requires_grad=False)
    at.q_proj.weight = new
    hf.model.layers[0].self_attn.q_proj.weight.data = new.detach().clone()
    with torch.no_grad():
        ref2 = hf(ids).logits
    assert _rel(ref2, ref) > 100 * TOL
    assert _rel(_ours_logits(lm, ids), ref2) <= TOL
    assert at._qkv is None


def test_positions_are_independent_per_row(tmp_path):
    """A batch of two different rows equals the rows run one at a time (no cross-row leakage)."""
    hf, lm, ids, ref = _check(tmp_path, seq=16, batch=3)
    for i in range(ids.shape[0]):
        one = _ours_logits(lm, ids[i:i + 1])
        assert _rel(one[0], ref[i]) <= TOL


def test_smollm2_gguf_matches_transformers_gguf_loader():
    """The default model (SmolLM2-135M Q4_1 GGUF, dequantized) against transformers' own GGUF loader."""
    from llmopt.models.loader import builtin_gguf
    gguf = builtin_gguf("smollm2-135m")
    lm = load_model(None, dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    text = "Robert Boulter is an English film, television and theatre actor. He had a guest role in 2000."
    ids = lm.tokenizer(text, return_tensors="pt").input_ids
    assert lm.config.num_hidden_layers == 30 and lm.config.tie_word_embeddings
    with torch.no_grad():
        ref = hf(ids).logits
    assert _rel(_ours_logits(lm, ids), ref) <= TOL
