"""The real tensors of a checkpoint file, read from headers only (nothing is loaded): names, shapes,
storage types and bytes, for safetensors folders and GGUF files."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from llmopt.models.gguf_file import ggml_nbytes, ggml_type_names, read_header
from llmopt.validate import safetensors_header

__all__ = ["TensorInfo", "ggml_nbytes", "ggml_type_names", "read_gguf", "safetensors_tensors"]

SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                     "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]      # logical shape, outermost first ([out, in] for a Linear weight)
    dtype: str                  # safetensors dtype (BF16, I32, F8_E4M3...) or GGML type name (Q4_K...)
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_gguf(path: Path) -> tuple[dict, list[TensorInfo]]:
    """A GGUF file's metadata (string arrays skipped) and tensor list, from its header alone."""
    h = read_header(path)
    return h.meta, [TensorInfo(t.name, t.shape, t.type_name, t.nbytes) for t in h.tensors]


def _header(path: Path) -> dict:
    """The header, checked against the file's size as the loader checks it (llmopt.validate)."""
    return safetensors_header(path)


def safetensors_tensors(folder: Path) -> list[TensorInfo] | None:
    """The tensors listed in the folder's *.safetensors headers; None when the weights are not here."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files or not all(f.is_file() for f in files):
        return None
    out = []
    for f in files:
        for name, meta in _header(f).items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            out.append(TensorInfo(name, tuple(meta["shape"]), meta["dtype"], end - start))
    return out
