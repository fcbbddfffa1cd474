"""A GGUF file's header, parsed by hand: the metadata (vocabulary strings skipped, not decoded) and
each tensor's name, shape, GGML type, bytes and place in the file. kv-estimate reads shapes and
bytes from it; llmopt.models.gguf_weights maps the tensors' bytes from the places it gives."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from llmopt.errors import ModelLoadError


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]      # outermost first ([out, in] for a Linear weight)
    type_name: str              # GGML type name (F32, Q4_K...)
    nbytes: int
    offset: int                 # from the start of the data section


@dataclass(frozen=True)
class GGUFHeader:
    meta: dict
    tensors: list[GGUFTensor]
    data_offset: int            # where the data section starts in the file


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


def read_header(path: Path) -> GGUFHeader:
    """A GGUF file's metadata (string arrays skipped) and tensor list, parsed from the header alone
    (gguf.GGUFReader decodes every vocabulary string: 9 s for the default model's 49k here)."""
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
                offset = c.take("<Q")
                shape = tuple(reversed(dims))      # GGUF lists the innermost dimension first
                numel = 1
                for d in dims:
                    numel *= d
                tensors.append(GGUFTensor(name, shape, type_name, ggml_nbytes(numel, type_name), offset))
            align = int(meta.get("general.alignment", 32))
            data_offset = -(-c.pos // align) * align
        except (struct.error, ValueError, OverflowError, MemoryError, IndexError, KeyError) as e:
            raise ModelLoadError(f"{path}: unreadable GGUF header ({e})") from e
        finally:
            c.buf.release()
    for t in tensors:
        if data_offset + t.offset + t.nbytes > size:
            raise ModelLoadError(f"{path} is truncated: tensor {t.name} ends past the file's {size:,} bytes")
    return GGUFHeader(meta, tensors, data_offset)
