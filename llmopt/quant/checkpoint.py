"""Checkpoint I/O for the layer-by-layer pipeline: memory-mapped reads by tensor name, shards
written atomically, and the metadata files (index, config with quantization_config, tokenizer and
generation config copied)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from llmopt.fsutil import MARKER, temp_path, write_atomic
from llmopt.models.config import ModelConfig
from llmopt.models.gguf_weights import FloatTensors
from llmopt.models.loader import safetensors_files

METADATA_SKIP = {"config.json", "model.safetensors.index.json", MARKER}   # written here, not copied
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


class CheckpointReader:
    """Tensors by name from a folder's safetensors files, read on demand from memory-mapped files;
    for a GGUF checkpoint, its tensors dequantized to float32 on demand."""

    def __init__(self, folder: Path, gguf: Path | None = None) -> None:
        from safetensors import safe_open
        self.folder = Path(folder)
        self._files = {}
        self._where: dict[str, str] = {}
        self._gguf = FloatTensors(gguf, ModelConfig.from_path(self.folder)) if gguf is not None else None
        if self._gguf is not None:
            self._where = {name: str(gguf) for name in self._gguf.names()}
            return
        for f in safetensors_files(self.folder):
            h = safe_open(str(f), framework="pt")
            self._files[str(f)] = h
            for name in h.keys():
                self._where[name] = str(f)

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        if self._gguf is not None:
            return self._gguf.get(name)
        return self._files[self._where[name]].get_tensor(name)

    def float_dtype(self) -> torch.dtype:
        for name in self._where:
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                return self.get(name).dtype
        return torch.float32


def save_shard(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Write one safetensors shard via `.NAME.tmp<PID>` and a rename; returns its part of the weight map."""
    from safetensors.torch import save_file
    tmp = temp_path(path)
    try:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {k: path.name for k in tensors}


def _write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n")


def write_metadata(source: Path, out: Path, weight_map: dict[str, str], quantization_config: dict | None,
                   dtype: torch.dtype) -> None:
    total = sum((out / f).stat().st_size for f in set(weight_map.values()))
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    config = json.loads((source / "config.json").read_text())
    if quantization_config:
        config["quantization_config"] = quantization_config
    dtype_name = str(dtype).replace("torch.", "")
    config["torch_dtype"] = dtype_name
    if "dtype" in config:
        config["dtype"] = dtype_name
    _write_json(out / "config.json", config)
    for f in source.iterdir():
        if f.is_file() and f.name not in METADATA_SKIP and not f.name.startswith(".") \
                and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(f, out / f.name)
