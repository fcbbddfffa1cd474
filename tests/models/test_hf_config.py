"""The one model description (llmopt/models/config.py) against transformers: for every kv-estimate
preset transformers knows and a set of tiny configs, the window of each layer, the KV heads and the
head dim are what transformers' config classes and attention modules make of the same dict; the
engine runs the model types it supports with those windows (logits past the window equal
transformers'); kv-estimate's import path stays torch-free; `auto` device/dtype resolve as the engine's."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
import torch
import transformers
from conftest import TINY, make_tiny
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from llmopt.errors import ModelLoadError, UserInputError
from llmopt.estimate.presets import MODEL_PRESETS
from llmopt.models.attention import DenseCausalAttention
from llmopt.models.config import (ModelConfig, parse_hf_config, resolve_device_name, resolve_dtype_name)
from llmopt.models.loader import load_model, resolve_dtype


def transformers_windows(cfg) -> list[int | None]:
    """Each layer's window as transformers' modeling code applies it. Mistral and Mixtral read
    `config.sliding_window` in forward for every layer (mask: create_sliding_window_causal_mask when it
    is set); every other attention module stores the window it uses as `self.sliding_window`, and
    Llama/DeepSeek-V3 attention has none."""
    n = cfg.num_hidden_layers
    if cfg.model_type in ("mistral", "mixtral"):
        return [cfg.sliding_window] * n
    module = importlib.import_module(f"transformers.models.{model_type_to_module_name(cfg.model_type)}."
                                     f"modeling_{model_type_to_module_name(cfg.model_type)}")
    attention = getattr(module, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg.model_type].replace("ForCausalLM", "Attention"))
    with torch.device("meta"):
        return [getattr(attention(cfg, i), "sliding_window", None) or None for i in range(n)]


def transformers_facts(d: dict) -> tuple:
    cfg = CONFIG_MAPPING[d["model_type"]](**{k: v for k, v in d.items() if k != "model_type"})
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return transformers_windows(cfg), cfg.num_key_value_heads, head_dim, bool(cfg.tie_word_embeddings)


def ours(d: dict) -> tuple:
    c = parse_hf_config(d)
    return c.layer_windows, c.num_key_value_heads, c.head_dim, c.tie_word_embeddings


PRESETS = [p for p in MODEL_PRESETS if p.config["model_type"] in CONFIG_MAPPING]


def test_every_preset_type_is_known_to_transformers():
    assert len(PRESETS) == len(MODEL_PRESETS)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.short)
def test_presets_match_transformers(preset):
    assert ours(dict(preset.config)) == transformers_facts(dict(preset.config))


T = {k: v for k, v in TINY.items() if k != "initializer_range"}
W = 8
TINY_CONFIGS = {
    "llama stray window": dict(T, model_type="llama", sliding_window=W),
    "llama layer_types": dict(T, model_type="llama", sliding_window=W, layer_types=["sliding_attention"] * 2),
    "mistral window": dict(T, model_type="mistral", sliding_window=W),
    "mistral none": dict(T, model_type="mistral", sliding_window=None),
    "mistral key absent": {k: v for k, v in dict(T, model_type="mistral").items()},
    "mistral default kv heads": {k: v for k, v in dict(T, model_type="mistral", num_attention_heads=8).items()
                                 if k != "num_key_value_heads"},
    "qwen2 use false": dict(T, model_type="qwen2", sliding_window=W, use_sliding_window=False, max_window_layers=0),
    "qwen2 use true mwl 1": dict(T, model_type="qwen2", sliding_window=W, use_sliding_window=True, max_window_layers=1),
    "qwen2 use true mwl default": dict(T, model_type="qwen2", sliding_window=W, use_sliding_window=True,
                                       num_hidden_layers=30),
    "qwen2 layer_types": dict(T, model_type="qwen2", sliding_window=W, use_sliding_window=True,
                              layer_types=["sliding_attention", "full_attention"]),
    "qwen2 layer_types use false": dict(T, model_type="qwen2", sliding_window=W, use_sliding_window=False,
                                        layer_types=["sliding_attention", "full_attention"]),
    "qwen3 use true mwl 1": dict(T, model_type="qwen3", sliding_window=W, use_sliding_window=True, max_window_layers=1),
    "qwen3 no head_dim": {k: v for k, v in dict(T, model_type="qwen3").items() if k != "head_dim"},
    "qwen2_moe window": dict(T, model_type="qwen2_moe", sliding_window=W, use_sliding_window=True, max_window_layers=5,
                             num_hidden_layers=6, num_experts=4, moe_intermediate_size=32),
    "qwen3_moe window": dict(T, model_type="qwen3_moe", sliding_window=W, use_sliding_window=True, num_experts=4,
                             moe_intermediate_size=32),
    "mixtral window": dict(T, model_type="mixtral", sliding_window=W, num_local_experts=4),
    "gemma2": dict(T, model_type="gemma2", sliding_window=W, num_hidden_layers=5),
    "gemma3_text": dict(T, model_type="gemma3_text", sliding_window=W, num_hidden_layers=7),
    "gemma3_text pattern 3": dict(T, model_type="gemma3_text", sliding_window=W, num_hidden_layers=7,
                                  sliding_window_pattern=3),
}


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_tiny_configs_match_transformers(name):
    d = TINY_CONFIGS[name]
    assert ours(d) == transformers_facts(d)


def test_the_windows_the_issue_names():
    """llama ignores a stray window (as the engine always did); qwen2's use_sliding_window=False means none."""
    assert ours(TINY_CONFIGS["llama stray window"])[0] == [None, None]
    assert ours(TINY_CONFIGS["qwen2 use false"])[0] == [None, None]
    assert ours(TINY_CONFIGS["qwen2 use true mwl 1"])[0] == [None, W]
    assert ours(TINY_CONFIGS["mistral key absent"])[0] == [4096, 4096]


def test_bad_configs_are_one_line_errors():
    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        parse_hf_config({"model_type": "llama", "hidden_size": 64})
    with pytest.raises(UserInputError, match="not a multiple"):
        parse_hf_config(dict(T, model_type="llama", num_key_value_heads=3))
    with pytest.raises(ModelLoadError, match="layer_types lists 3 layers"):
        parse_hf_config(dict(T, model_type="qwen2", layer_types=["full_attention"] * 3))
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gemma2'"):
        ModelConfig.from_hf_dict(TINY_CONFIGS["gemma2"])


# --- the engine runs what the parser says ---------------------------------------------------------

ENGINE_CASES = {
    "llama": dict(sliding_window=W),                                           # stray: ignored
    "mistral": dict(sliding_window=W),
    "qwen2": dict(sliding_window=W, use_sliding_window=True, max_window_layers=1),
    "qwen3": dict(sliding_window=W, use_sliding_window=True, layer_types=["full_attention", "sliding_attention"]),
}


def _logits(lm, ids):
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return lm.model.compute_logits(lm.model(ids, pos, DenseCausalAttention()))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("model_type", ENGINE_CASES)
def test_engine_runs_the_parsed_windows_like_transformers(tmp_path, model_type):
    folder = make_tiny(tmp_path, model_type, **ENGINE_CASES[model_type])
    d = json.loads((folder / "config.json").read_text())
    lm = load_model(str(folder), dtype="float32", device="cpu", tokenizer=False)
    assert lm.config.layer_windows == transformers_facts(d)[0]
    assert [layer.self_attn.window for layer in lm.model.model.layers] == lm.config.layer_windows
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    assert _rel(_logits(lm, ids), ref) <= 1e-4
    # sensitivity: the other choice of windows moves the logits past the window
    flipped = [W if w is None else None for w in lm.config.layer_windows]
    for layer, w in zip(lm.model.model.layers, flipped):
        layer.self_attn.window = w
    assert _rel(_logits(lm, ids), ref) > 1e-2


# --- torch-free, and one meaning of auto ----------------------------------------------------------

def test_kv_estimate_import_path_has_no_torch():
    code = ("import sys; from llmopt.cli import kv_estimate; from llmopt.estimate import estimate, resolve_model_arch; "
            "import llmopt.models.config, llmopt.models; "
            "e = estimate(resolve_model_arch(None), kv_cache_memory=1 << 30, device='auto'); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("checkpoint", ["float32", "bfloat16", "float16", "torch.float16", "float8_e4m3fn"])
@pytest.mark.parametrize("dtype", ["auto", "float32", "bf16", "float16"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_dtype_resolution_is_the_loaders(checkpoint, dtype, device):
    name = resolve_dtype_name(dtype, device, checkpoint)
    assert getattr(torch, name) == resolve_dtype(dtype, torch.device(device), checkpoint)
    if dtype == "auto":
        expected = "float32" if device == "cpu" else {"torch.float16": "float16", "float8_e4m3fn": "bfloat16"}.get(
            checkpoint, checkpoint)
        assert name == expected


def test_device_resolution():
    assert resolve_device_name("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device_name("auto", gpu_planned=True) == "cuda"
    assert resolve_device_name("cuda", must_exist=False) == "cuda"
    with pytest.raises(UserInputError, match="unknown device"):
        resolve_device_name("tpu")
    with pytest.raises(UserInputError, match="unknown dtype"):
        resolve_dtype_name("int3", "cpu")
