"""Checks of what users hand the toolkit, shared by the commands and the library, each raising one
of llmopt.errors' one-line errors that says what was given and what is allowed:

- `safetensors_header`: a checkpoint file's header, read and checked against the file's size
  (a truncated download, a garbage or empty file) before safetensors or torch touch it; the loader,
  the quantizer's reader and kv-estimate all go through it.
- `decode_utf8`: text the user wrote (prompts from --file or stdin, a YAML recipe), strict UTF-8.
- `available_memory` / `check_kv_cache_memory`: a KV cache larger than the device is refused up
  front, as vLLM refuses one, instead of failing inside the allocator.
- `check_engine_limits`: the engine's sizes (--block-size, --max-num-seqs, --max-num-batched-tokens,
  --max-model-len, --gpu-memory-utilization), for EngineArgs and for kv-estimate's plans alike.
- `SEED_MIN`, `SEED_MAX`: a seed is a 64-bit integer (vLLM's range: torch.long); `sample_seed`:
  the seed of sample i of n, inside that range.

No torch at import time (kv-estimate imports this and stays fast)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from llmopt.errors import ModelLoadError, UserInputError

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1      # torch.iinfo(torch.long), as vLLM's seed field
SAFETENSORS_MAX_HEADER = 100 << 20                  # the safetensors library refuses larger headers
MAX_BLOCK_SIZE = 1 << 16       # tokens per KV block at most (vLLM's largest is 128; one block is one allocation)
MAX_TOKENS = (1 << 31) - 1     # token counts, positions and slots are int32 indices on the device


def check_engine_limits(*, block_size: int, max_num_seqs: int, max_num_batched_tokens: int | None,
                        max_model_len: int | None = None, gpu_memory_utilization: float = 1.0) -> None:
    """The engine's sizes, each an integer in its range (None: not given; max_num_batched_tokens 0:
    unlimited); the message names the flag, what was given and what is allowed."""
    for flag, v, lo, hi, note in (("--block-size", block_size, 1, MAX_BLOCK_SIZE, ""),
                                  ("--max-num-seqs", max_num_seqs, 1, MAX_TOKENS, ""),
                                  ("--max-num-batched-tokens", max_num_batched_tokens, 0, MAX_TOKENS, " (0 = unlimited)"),
                                  ("--max-model-len", max_model_len, 2, MAX_TOKENS, "")):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
            raise UserInputError(f"{flag} {v}: give an integer from {lo} to {hi:,}{note}")
    if not 0 < gpu_memory_utilization <= 1:
        raise UserInputError(f"--gpu-memory-utilization {gpu_memory_utilization}: use a share of the "
                             "GPU's memory in (0, 1], as vLLM")


def sample_seed(seed: int, i: int) -> int:
    """Sample i's seed for a request of n samples seeded with `seed`: seed + i, wrapped into
    [SEED_MIN, SEED_MAX] (the same as seed + i for every seed but the last n - 1)."""
    return (seed + i - SEED_MIN) % (1 << 64) + SEED_MIN


def safetensors_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file (tensor name -> dtype, shape, data_offsets, plus
    `__metadata__`), after checking that the file holds exactly the bytes the header describes."""
    p = Path(path)
    size = p.stat().st_size
    damaged = f"{p} is a damaged safetensors file"
    with open(p, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelLoadError(f"{damaged}: {size} bytes, too short for a header (a truncated download?)")
        (n,) = struct.unpack("<Q", raw)
        if n > SAFETENSORS_MAX_HEADER or 8 + n > size:
            raise ModelLoadError(f"{damaged}: its first 8 bytes announce a {n:,}-byte header, the file has "
                                 f"{size:,} bytes (truncated, or not safetensors)")
        blob = f.read(n)
    try:
        header = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{damaged}: its header is not JSON ({e.__class__.__name__} at byte "
                             f"{getattr(e, 'pos', getattr(e, 'start', 0))})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{damaged}: its header is not a JSON object")
    end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = (int(x) for x in meta["data_offsets"])
            shape = [int(d) for d in meta["shape"]]
            str(meta["dtype"])
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{damaged}: tensor {name!r} has no valid dtype, shape and data_offsets") from None
        if not 0 <= start <= stop or any(d < 0 for d in shape):
            raise ModelLoadError(f"{damaged}: tensor {name!r} has data_offsets {[start, stop]} and shape {shape}")
        end = max(end, stop)
    if 8 + n + end != size:
        how = "truncated" if 8 + n + end > size else "has trailing bytes"
        raise ModelLoadError(f"{damaged}: {how}: its tensors end at byte {8 + n + end:,}, the file has "
                             f"{size:,} bytes")
    return header


def decode_utf8(raw: bytes, where: str) -> str:
    """Strict UTF-8 text (a BOM dropped); the error names `where` and the first bad byte."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserInputError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start}: 0x{raw[e.start]:02x}); "
                             "convert it, e.g. iconv -f latin1 -t utf-8") from None
    return text.removeprefix("\ufeff")


def available_memory(device_type: str, index: int | None = None) -> int | None:
    """Bytes the device can still give: MemAvailable of /proc/meminfo (else the physical pages the
    OS reports) on the CPU, free memory on a CUDA device; None when unknown."""
    if device_type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    if device_type == "cuda":
        import torch
        free, _total = torch.cuda.mem_get_info(index)
        return int(free)
    return None


def kv_cache_memory_problem(nbytes: int, device_type: str, index: int | None = None) -> str | None:
    """Why this device cannot hold a --kv-cache-memory of `nbytes` (None: it can)."""
    free = available_memory(device_type, index)
    if free is not None and nbytes > free:
        return (f"--kv-cache-memory {fmt_bytes(nbytes)} is more than the {fmt_bytes(free)} "
                f"{'available RAM' if device_type == 'cpu' else 'free GPU memory'} of this "
                f"{device_type}: give at most that (e.g. 1GiB)")
    return None


def check_kv_cache_memory(nbytes: int, device_type: str, index: int | None = None) -> None:
    """Refuse a --kv-cache-memory the device cannot hold (vLLM refuses a KV cache larger than the
    memory left after the model), before anything is allocated."""
    problem = kv_cache_memory_problem(nbytes, device_type, index)
    if problem is not None:
        raise UserInputError(problem)


def fmt_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"
