"""Kernels for the paged KV cache and the decoder's hot ops, behind one dispatch point.

Backends: "torch" (llmopt/kernels/reference.py, the CPU default and the tests' oracle), "triton"
(triton_*.py: GPU kernels; on CPU tensors only under TRITON_INTERPRET=1) and "auto" (triton for
CUDA tensors, torch otherwise). The engine exposes the choice as `--attention-backend`.
Signatures: docs/design.md, "Paged KV cache".
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from llmopt.errors import UserInputError
from llmopt.kernels import reference
from llmopt.kernels.reference import KV_DTYPES, kv_block_bytes, kv_cache_torch_dtype

BACKENDS = ("auto", "torch", "triton")
_backend = "auto"


def set_backend(name: str) -> None:
    """Choose the kernels: "torch", "triton" or "auto" (triton on CUDA, torch on the CPU)."""
    global _backend
    if name not in BACKENDS:
        raise UserInputError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "triton":
        _triton_available(raise_why=True)
    _backend = name


def get_backend() -> str:
    return _backend


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_available(raise_why: bool = False) -> bool:
    if not _has_triton() and raise_why:
        raise UserInputError("the triton backend needs the `triton` package (pip install triton)")
    return _has_triton()


def _use_triton(t: torch.Tensor) -> bool:
    if _backend == "torch":
        return False
    if _backend == "auto":
        return t.is_cuda and _triton_available()
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserInputError("the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 set before importing "
                             "triton); use --attention-backend torch on the CPU")
    return True


def write_kv(key_cache, value_cache, k, v, slot_mapping, kv_dtype, k_scale, v_scale,
             k_scale_cache=None, v_scale_cache=None) -> None:
    """Store k, v [N, Hkv, D] into the paged cache at `slot_mapping` [N] (negative = skip)."""
    if _use_triton(k):
        from llmopt.kernels import triton_kv as impl
    else:
        impl = reference
    impl.write_kv(key_cache, value_cache, k, v, slot_mapping, kv_dtype, k_scale, v_scale, k_scale_cache, v_scale_cache)


def paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, window,
                    kv_dtype, k_scale, v_scale, k_scale_cache=None, v_scale_cache=None) -> torch.Tensor:
    """Varlen causal (optionally sliding-window) GQA attention over the paged cache."""
    if _use_triton(q):
        from llmopt.kernels import triton_attention as impl
    else:
        impl = reference
    return impl.paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, window,
                                kv_dtype, k_scale, v_scale, k_scale_cache, v_scale_cache)


def rms_norm(x, weight, eps, residual=None):
    """RMSNorm over the last dim; with `residual`, fused add: returns (normed, x + residual)."""
    if _use_triton(x):
        from llmopt.kernels import triton_norm as impl
    else:
        impl = reference
    return impl.rms_norm(x, weight, eps, residual)


def rotary(q, k, cos, sin):
    """Rotate-half RoPE on q [N, Hq, D], k [N, Hkv, D] with cos/sin [N, D]; returns (q, k)."""
    if _use_triton(q):
        from llmopt.kernels import triton_norm as impl
    else:
        impl = reference
    return impl.rotary(q, k, cos, sin)


def w4a16_matmul(x, qweight, scales, zeros, group_size, bits=4):
    """Group-wise W4A16/W8A16 dequantize-GEMM (Triton; layout in llmopt/kernels/w4a16.py)."""
    from llmopt.kernels.w4a16 import w4a16_matmul as impl
    return impl(x, qweight, scales, zeros, group_size, bits)


__all__ = ["BACKENDS", "KV_DTYPES", "get_backend", "kv_block_bytes", "kv_cache_torch_dtype", "paged_attention",
           "rms_norm", "rotary", "set_backend", "w4a16_matmul", "write_kv"]
