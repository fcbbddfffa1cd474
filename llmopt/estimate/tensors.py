"""The real tensors of a checkpoint file, read from headers only (nothing is loaded): names, shapes,
storage types and bytes, for safetensors folders and GGUF files."""

from __future__ import annotations

import math

import json
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from llmopt.errors import ModelLoadError
from llmopt.validate import safetensors_header

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


def ggml_nbytes(n_elements: int, type_name: str) -> int:
    """Bytes of n elements stored as a GGML type: n / block_size * bytes_per_block (gguf's table)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name.upper()]]
    except KeyError as e:
        raise ModelLoadError(f"unknown GGML type {type_name!r}") from e
    if n_elements % block:
        raise ModelLoadError(f"{n_elements} elements are not a whole number of {type_name} blocks of {block}")
    return n_elements // block * size


@lru_cache(maxsize=1)
def ggml_type_names() -> frozenset[str]:
    from gguf.constants import GGML_QUANT_SIZES
    return frozenset(t.name for t in GGML_QUANT_SIZES)


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class _Cursor:
    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self, decode: bool = True):
        n = self.take("<Q")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return bytes(raw).decode("utf-8", "replace") if decode else None

    def value(self, vtype: int):
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, count = self.take("<I"), self.take("<Q")
            if itype in _GGUF_SCALARS:
                fmt = _GGUF_SCALARS[itype]
                size = struct.calcsize(fmt)
                out = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
                self.pos += size * count
                return out
            for _ in range(count):      # arrays of strings (the vocabulary): skipped, not decoded
                self.value(itype) if itype == 9 else self.string(decode=False)
            return None
        return self.take(_GGUF_SCALARS[vtype])


def read_gguf(path: Path) -> tuple[dict, list[TensorInfo]]:
    """A GGUF file's metadata (string arrays skipped) and tensor list, parsed from the header alone
    (gguf.GGUFReader decodes every vocabulary string, seconds on a busy machine)."""
    import mmap
    from gguf.constants import GGMLQuantizationType
    size = Path(path).stat().st_size
    if size < 24:   # magic, version, two counts: mmap refuses an empty file
        raise ModelLoadError(f"{path} is not a GGUF file: {size} bytes, shorter than a GGUF header "
                             "(an interrupted download?)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        c = _Cursor(memoryview(mm))
        try:
            if bytes(c.buf[:4]) != b"GGUF":
                raise ModelLoadError(f"{path} is not a GGUF file")
            c.pos = 4
            c.take("<I")
            n_tensors, n_kv = c.take("<Q"), c.take("<Q")
            meta = {}
            for _ in range(n_kv):
                key = c.string()
                meta[key] = c.value(c.take("<I"))
            tensors = []
            for _ in range(n_tensors):
                name = c.string()
                dims = [c.take("<Q") for _ in range(c.take("<I"))]
                type_name = GGMLQuantizationType(c.take("<I")).name
                c.take("<Q")
                shape = tuple(reversed(dims))      # GGUF lists the innermost dimension first
                numel = 1
                for d in dims:
                    numel *= d
                tensors.append(TensorInfo(name, shape, type_name, ggml_nbytes(numel, type_name)))
        except (struct.error, ValueError, OverflowError, MemoryError, IndexError, KeyError) as e:
            raise ModelLoadError(f"{path}: unreadable GGUF header ({e})") from e
        finally:
            c.buf.release()
    return meta, tensors


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
