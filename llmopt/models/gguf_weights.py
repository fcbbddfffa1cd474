"""The weights of a GGUF file, read as stored.

- `install`: on the CPU, each Linear (and the token table) whose tensor is one of the block formats
  the kernels multiply (llmopt.layers.formats.ggml: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
  Q6_K) becomes a GGMLLinear / GGMLEmbedding built from the memory-mapped blocks, a tensor at a
  time, and each F16 / BF16 matrix a Linear16 / Embedding16 holding it as stored (whatever
  `--dtype`: a GGUF runs as stored); on CUDA (with Triton) the same block types are repacked once
  for the Triton dequantize-GEMM. Every other tensor comes out dequantized (float32, one at a time)
  for `load_weights` to cast to the model's dtype, with one log line naming the quantized types
  that took that path. On the CPU (one rank), an MXFP4 Linear becomes a GGUFMxfp4Linear holding its
  blocks, run as 4-bit E2M1 codes and float32 block scales (llmopt.layers.modules_fp4).
- `iter_float_weights` / `FloatTensors`: the same tensors dequantized, by Hugging Face name, for
  the readers that want floats (quantize's input, the self-draft).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn as nn

from llmopt.errors import ModelLoadError
from llmopt.ggml_types import FLOAT16_TYPES, RUN_TYPES
from llmopt.kernels import has_triton
from llmopt.layers.runtime import trim_heap
from llmopt.layers.formats.ggml import decode
from llmopt.models.gguf_file import GGUFTensor, read_header

log = logging.getLogger("llmopt.models")
FLOAT_TYPES = ("F32", "F16", "BF16")
ROPE_FREQS = "rope_freqs.weight"   # Llama 3.x's RoPE factors: read into the config (gguf_convert), not a weight

_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}

_GGUF_TOP = {v: k for k, v in _TENSOR_NAMES.items()}
_GGUF_LAYER = {v: k for k, v in _LAYER_NAMES.items()}


def hf_name(gguf_name: str) -> str:
    if gguf_name in _TENSOR_NAMES:
        return _TENSOR_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")


def gguf_name(name: str) -> str:
    """The GGUF name of a Hugging Face tensor name (hf_name's inverse)."""
    if name in _GGUF_TOP:
        return _GGUF_TOP[name]
    _, _, layer, rest = name.split(".", 3)
    module, _, param = rest.rpartition(".")
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{param}"


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp stores q/k rows interleaved for its RoPE; undo it for rotate-half RoPE."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope(w, n_head: int):
    """llama.cpp's q/k row order (unpermute_rope's inverse), for a tensor or an array."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """A GGUF file's header and its tensors' bytes, each tensor memory-mapped on its own (read-only),
    so that once it is decoded its mapping, and the file pages it brought in, go with it: loading
    holds one tensor of the file at a time, not the file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.header = read_header(self.path)

    @property
    def tensors(self) -> list[GGUFTensor]:
        """The weights (rope_freqs.weight is the config's: gguf_convert)."""
        return [t for t in self.header.tensors if t.name != ROPE_FREQS]

    def raw(self, t: GGUFTensor) -> np.ndarray:
        """uint8 [rows, bytes a row] (rows: every dimension but the innermost)."""
        rows = math.prod(t.shape[:-1])
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.header.data_offset + t.offset,
                         shape=(rows, t.nbytes // rows))


def _rope_heads(gguf_name: str, cfg) -> int | None:
    """llama.cpp stores q/k rows interleaved for its RoPE: the head count to undo it with."""
    if gguf_name.endswith("attn_q.weight"):
        return cfg.num_attention_heads
    if gguf_name.endswith("attn_k.weight"):
        return cfg.num_key_value_heads
    return None


_TORCH_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def dequantized(f: GGUFFile, t: GGUFTensor, cfg) -> torch.Tensor:
    """One tensor as float32 in PyTorch's shape, q/k rows in rotate-half order."""
    raw = f.raw(t)
    if t.type_name in _TORCH_FLOATS:   # a copy: the map is read-only and closes after loading
        w = torch.from_numpy(np.array(raw)).view(_TORCH_FLOATS[t.type_name]).float()
    else:
        import gguf   # deferred: start-up time (the reference dequantizers of every GGML type)
        arr = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[t.type_name])
        w = torch.from_numpy(np.asarray(arr, dtype=np.float32))
    w = w.reshape(t.shape)
    heads = _rope_heads(t.name, cfg)
    return unpermute_rope(w, heads).contiguous() if heads else w


def iter_float_weights(path: Path, cfg) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) pairs of a GGUF file, dequantized one at a time."""
    f = GGUFFile(path)
    for t in f.tensors:
        yield hf_name(t.name), dequantized(f, t, cfg)


class FloatTensors:
    """Dequantized tensors by Hugging Face name, read on demand (quantize's CheckpointReader)."""

    def __init__(self, path: Path, cfg) -> None:
        self.cfg = cfg
        self.file = GGUFFile(path)
        self._by_name = {hf_name(t.name): t for t in self.file.tensors}

    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str) -> torch.Tensor:
        return dequantized(self.file, self._by_name[name], self.cfg)


def _grouped(f: GGUFFile, t: GGUFTensor, cfg, pack: bool):
    g = decode(t.type_name, f.raw(t), t.shape[1], pack=pack)
    heads = _rope_heads(t.name, cfg)
    if heads:   # (rows: packed codes permute as they are)
        g.codes, g.scales = unpermute_rope(g.codes, heads), unpermute_rope(g.scales, heads)
        g.szeros = unpermute_rope(g.szeros, heads) if g.szeros.dim() == 2 else g.szeros
    return g


def install(model: nn.Module, path: Path, cfg, dtype: torch.dtype, device: torch.device,
            tp=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Swap the model's (meta) Linears and token table for GGML modules where the tensor's type
    runs on the CPU kernels (or the Triton ones on CUDA); yields the other tensors as (name, float32
    tensor) for load_weights. `tp` (a llmopt.distributed.parallel.TPGroup): each GGML module holds
    the rank's slice of the decoded tensor (load_weights cuts the tensors yielded)."""
    from llmopt.layers.modules_ggml import GGMLEmbedding, GGMLLinear   # deferred: start-up time
    from llmopt.layers.modules16 import holder_16bit   # deferred: start-up time
    from llmopt.layers.modules_fp4 import GGUFMxfp4Linear   # deferred: start-up time
    f = GGUFFile(path)
    tied = "output.weight" not in {t.name for t in f.tensors}
    fallback: dict[str, int] = {}
    triton = device.type == "cuda"
    kernels = device.type == "cpu" or (triton and has_triton())
    for t in f.tensors:
        name, kind = hf_name(t.name), t.type_name
        target = name.removesuffix(".weight")
        if kind == "MXFP4" and device.type == "cpu" and tp is None and _is_linear_weight(model, name, t):
            lin = model.get_submodule(target)
            model.set_submodule(target, GGUFMxfp4Linear(_raw_rows(f, t, cfg), t.shape[1], lin.bias is not None))
            continue
        runs = kernels and kind in RUN_TYPES and len(t.shape) == 2 and name.endswith(".weight")
        if runs:
            g = _grouped(f, t, cfg, pack=not triton)   # (CPU: Q4_x nibbles decoded straight into the kernels' layout)
            g = g if tp is None else tp.shard_grouped(name, g)
        if runs and target == "model.embed_tokens":
            table = GGMLLinear(g, kind, triton, device)
            model.model.embed_tokens = GGMLEmbedding(table, dtype, owner=not tied)
            if tied:
                model.lm_head = table
            trim_heap()
            continue
        if runs and isinstance(model.get_submodule(target), nn.Linear) and model.get_submodule(target).bias is None:
            model.set_submodule(target, GGMLLinear(g, kind, triton, device))
            trim_heap()   # the tensor's decoding temporaries, before the next tensor's
            continue
        if device.type == "cpu" and kind in FLOAT16_TYPES and len(t.shape) == 2 and name.endswith(".weight") and \
                (target == "model.embed_tokens" or type(model.get_submodule(target)) is nn.Linear):
            dt = _TORCH_FLOATS[kind]   # a 16-bit holder on meta, filled by load_weights as stored
            for held in [target] + (["lm_head"] if target == "model.embed_tokens" and tied else []):
                model.set_submodule(held, holder_16bit(model.get_submodule(held), dt))
            yield name, _float16(f, t, cfg)
            continue
        if kind not in FLOAT_TYPES:
            fallback[kind] = fallback.get(kind, 0) + 1
        yield name, dequantized(f, t, cfg)
    if fallback:
        what = ", ".join(f"{k} ({n} tensors)" for k, n in sorted(fallback.items()))
        where = (f"the {'CPU' if device.type == 'cpu' else 'Triton'} kernels run " + ", ".join(RUN_TYPES) if kernels
                 else f"on {device.type}")
        log.info(f"GGUF {path.name}: {what} dequantized to {str(dtype).replace('torch.', '')} ({where})")


def _is_linear_weight(model: nn.Module, name: str, t: GGUFTensor) -> bool:
    target = name.removesuffix(".weight")
    return (len(t.shape) == 2 and name.endswith(".weight") and target != "model.embed_tokens"
            and type(model.get_submodule(target)) is nn.Linear)


def _raw_rows(f: GGUFFile, t: GGUFTensor, cfg) -> torch.Tensor:
    """A tensor's rows of blocks as stored (uint8 [rows, bytes a row], a copy), q/k rows in rotate-half order."""
    raw = torch.from_numpy(np.array(f.raw(t)))
    heads = _rope_heads(t.name, cfg)
    return unpermute_rope(raw, heads).contiguous() if heads else raw


def _float16(f: GGUFFile, t: GGUFTensor, cfg) -> torch.Tensor:
    """An F16 / BF16 matrix as stored (a copy: the map is read-only), q/k rows in rotate-half order."""
    w = torch.from_numpy(np.array(f.raw(t))).view(_TORCH_FLOATS[t.type_name]).reshape(t.shape)
    heads = _rope_heads(t.name, cfg)
    return unpermute_rope(w, heads).contiguous() if heads else w


def runs_quantized(model: nn.Module) -> bool:
    """Whether `install` gave the model any GGML module (a float GGUF has none)."""
    from llmopt.layers.modules_ggml import GGMLLinear   # deferred: start-up time
    from llmopt.layers.modules_fp4 import GGUFMxfp4Linear   # deferred: start-up time
    return any(isinstance(m, (GGMLLinear, GGUFMxfp4Linear)) for m in model.modules())
