"""The sampling defaults of a checkpoint's `generation_config.json`, as vLLM's `--generation-config
auto` reads them: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens (as
`max_tokens`, vLLM's name), for the fields a request leaves out. A folder without the file has none; a
field of the wrong type or out of range is one line naming the field and the file."""

from __future__ import annotations

import json
import math
from pathlib import Path

from llmopt.errors import ModelLoadError, UserInputError

FILE = "generation_config.json"
FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
          "max_new_tokens": int}
RENAMED = {"max_new_tokens": "max_tokens"}   # the file's name -> SamplingParams' (vLLM's get_diff_sampling_param)


def generation_defaults(folder: Path) -> dict[str, float | int]:
    """The sampling fields of `folder/generation_config.json` ({} without the file)."""
    path = Path(folder) / FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    out: dict[str, float | int] = {}
    for name, kind in FIELDS.items():
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
            raise ModelLoadError(f"{path}: {name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        if not math.isfinite(value):
            raise ModelLoadError(f"{path}: {name} must be a finite number, got {value!r}")
        if name == "max_new_tokens" and value < 1:
            raise ModelLoadError(f"{path}: max_new_tokens must be at least 1, got {value!r}")
        out[RENAMED.get(name, name)] = kind(value)
    return out


def resolve_generation_defaults(choice: str, model_folder: Path) -> dict[str, float | int]:
    """vLLM's --generation-config: `auto` reads the model's folder, `vllm` none, a folder its file."""
    if choice == "vllm":
        return {}
    if choice == "auto":
        return generation_defaults(model_folder)
    folder = Path(choice)
    if not (folder / FILE).is_file():
        raise UserInputError(f"--generation-config {choice}: no {FILE} there (give auto, vllm or a folder holding one)")
    return generation_defaults(folder)
