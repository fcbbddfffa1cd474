"""Where a ModelArch comes from: a checkpoint folder (config.json + safetensors headers), a .gguf
(its header, mapped by models/config.py's gguf_hf_config as the GGUF converter maps it), the default
model (models/config.py's builtin_gguf), a Hugging Face id in the local cache (offline), or a preset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmopt import defaults
from llmopt.errors import ModelLoadError
from llmopt.estimate import presets
from llmopt.estimate.arch import ModelArch, apply_overrides, arch_from_config
from llmopt.estimate.tensors import read_gguf, safetensors_tensors
from llmopt.models.config import builtin_gguf, gguf_hf_config, read_config_json


def _hf_cache_config(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
        p = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - a malformed id or cache: treat as not cached
        return None
    return Path(p) if isinstance(p, str) else None


def _from_folder(folder: Path, name: str, source: str) -> ModelArch:
    d = read_config_json(folder)     # the loader's reading: JSON object, UTF-8, one-line errors
    origin = str(folder / "config.json")
    try:
        arch = arch_from_config(d, name, source, origin)
    except ModelLoadError as first:
        # a multimodal config's text_config lists only non-default values (Gemma-3's omits
        # vocab_size...): let transformers fill in its defaults there (importing it takes seconds).
        # A plain decoder config must name its fields, as the engine's loader requires.
        if "text_config" not in d:
            raise
        try:
            from transformers import AutoConfig
            full = AutoConfig.from_pretrained(str(folder)).to_dict()
        except Exception:  # noqa: BLE001 - unknown to transformers too: report the first problem
            raise first from None
        arch = arch_from_config(full, name, source, origin)
    arch.tensors = safetensors_tensors(folder)
    return arch


def _from_gguf(path: Path, name: str, source: str) -> ModelArch:
    meta, tensors = read_gguf(path)
    try:
        d = gguf_hf_config(meta, [(t.name, t.shape) for t in tensors])
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    arch = arch_from_config(d, name, source, str(path))
    arch.tensors = tensors
    return arch


def resolve_model_arch(model: str | None = None, overrides: dict[str, Any] | None = None) -> ModelArch:
    """Folder / .gguf / default model / HF id in the local cache / preset, then overrides."""
    name = model or defaults.DEFAULT_MODEL
    p = Path(name).expanduser()
    if name in defaults.BUILTIN_MODELS:
        arch = _from_gguf(builtin_gguf(name), name, "builtin")
    elif p.is_file() and p.suffix == ".gguf":
        arch = _from_gguf(p, p.name, "gguf")
    elif p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{p} has no config.json: it is not a Hugging Face checkpoint folder")
        arch = _from_folder(p, p.name, "config")
    elif p.is_file() and p.name == "config.json":
        arch = _from_folder(p.parent, p.parent.name, "config")
    elif p.exists():
        raise ModelLoadError(f"{p} is neither a checkpoint folder, a config.json nor a .gguf file")
    elif (cached := _hf_cache_config(name) if name.count("/") == 1 else None) is not None:
        arch = _from_folder(cached.parent, name, "hf-cache")
    elif (preset := presets.find_model_preset(name)) is not None:
        arch = arch_from_config(dict(preset.config), preset.hf_id, "preset", preset.url, preset.note)
    else:
        raise ModelLoadError(f"model {name!r} not found: give a checkpoint folder, a .gguf, a Hugging Face id in "
                             f"the local cache, or a preset (llmopt kv-estimate --list-presets)")
    return apply_overrides(arch, overrides or {})
