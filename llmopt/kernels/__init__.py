"""Kernels for the paged KV cache and the decoder's hot ops, behind one dispatch point.

Every entry point takes the backend explicitly (keyword `backend`): "torch"
(llmopt/kernels/reference.py, the CPU default and the tests' oracle), "triton" (triton_*.py: GPU
kernels; on CPU tensors only under TRITON_INTERPRET=1) or "auto" (triton for CUDA tensors, torch
otherwise). There is no module-level choice: the engine's runner carries its backend
(`--attention-backend`, checked once by `resolve_backend`), so engines with different backends
can share a process. Signatures: docs/design.md, "Paged KV cache".
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import torch

from llmopt.errors import UserInputError
from llmopt.kernels import reference
from llmopt.kernels.reference import KV_DTYPES, kv_block_bytes, kv_cache_torch_dtype, kv_head_width

BACKENDS = ("auto", "torch", "triton")


@functools.cache
def has_triton() -> bool:
    """Whether the triton package is installed (its kernels run on CUDA, or under TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None


def _check_name(name: str) -> None:
    if name not in BACKENDS:
        raise UserInputError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "triton" and not has_triton():
        raise UserInputError("the triton backend needs the `triton` package (pip install triton)")


def _triton_for(backend: str, device: torch.device) -> bool:
    """Whether `backend` runs Triton kernels on tensors of `device`."""
    _check_name(backend)
    if backend == "torch":
        return False
    if backend == "auto":
        return device.type == "cuda" and has_triton()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserInputError("the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 set before importing "
                             "triton); use --attention-backend torch on the CPU")
    return True


def resolve_backend(name: str, device: torch.device | str) -> str:
    """The concrete backend ("torch" or "triton") that `name` means on `device`; raises
    UserInputError for an unknown name or a backend that cannot run there."""
    return "triton" if _triton_for(name, torch.device(device)) else "torch"


def _impl(backend: str, t: torch.Tensor, module: str):
    if backend == "torch":       # what the runner passes on the CPU (resolved once by resolve_backend): no checks
        return reference
    if backend == "triton" and t.is_cuda:
        return importlib.import_module(f"llmopt.kernels.{module}")
    return importlib.import_module(f"llmopt.kernels.{module}") if _triton_for(backend, t.device) else reference


def write_kv(key_cache, value_cache, k, v, slot_mapping, kv_dtype, k_scale, v_scale,
             k_scale_cache=None, v_scale_cache=None, *, backend: str, kept=None) -> None:
    """Store k, v [N, Hkv, D] into the paged cache at `slot_mapping` [N] (negative = skip). kept:
    the reference's `real_slots(slot_mapping)`, made once per step (only the reference reads it)."""
    impl = _impl(backend, k, "triton_kv")
    args = (key_cache, value_cache, k, v, slot_mapping, kv_dtype, k_scale, v_scale, k_scale_cache, v_scale_cache)
    if impl is reference:
        impl.write_kv(*args, kept=kept)
    else:
        impl.write_kv(*args)


def paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, window,
                    kv_dtype, k_scale, v_scale, k_scale_cache=None, v_scale_cache=None, *,
                    backend: str, plan=None, pages=None) -> torch.Tensor:
    """Varlen causal (optionally sliding-window) GQA attention over the paged cache. plan: a callable
    giving the reference's `decode_plan(...)` for this call, made once per step by the caller (only
    the reference path asks for it). pages: kivi2's (key_pages, value_pages, quant_blocks [S]), the
    caches being its full-precision residual (llmopt/kernels/kivi.py)."""
    if backend == "torch" and _cpp_decode(q, key_cache, seq_lens):   # a decode-only step on the CPU: the cache
        reference._check_int8_scales(kv_dtype, k_scale_cache, v_scale_cache)   # (and kivi2's pages) read in place
        key_pages, value_pages, quant_blocks = pages if pages is not None else (None, None, None)
        return _cpu_ops().decode_attention(q, key_cache, value_cache, block_tables.int().contiguous(),
                                           seq_lens.int().contiguous(), scale, -1 if window is None else window,
                                           float(k_scale), float(v_scale), k_scale_cache, v_scale_cache, key_pages,
                                           value_pages, None if pages is None else quant_blocks.int().contiguous())
    impl = _impl(backend, q, "triton_attention")
    args = (q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, window, kv_dtype, k_scale,
            v_scale, k_scale_cache, v_scale_cache)
    if impl is reference:
        return impl.paged_attention(*args, plan=plan() if plan is not None else None, pages=pages)
    if pages is not None:
        return impl.paged_attention(*args, pages=pages)
    return impl.paged_attention(*args)


def _cpu_ops():
    from llmopt.kernels import cpu_quant   # deferred: start-up time (its C++ library builds on first use)
    return cpu_quant.ops()


def _cpp_decode(q, key_cache, seq_lens) -> bool:
    """One query per sequence (q rows == sequences), float32 on the CPU, and the C++ kernels built:
    llmopt_cpu.decode_attention reads the paged cache (kivi2: its residual and pages) in place (the
    reference gathers each block)."""
    return (q.shape[0] == seq_lens.shape[0] and q.dtype == torch.float32 and key_cache.dtype in CPP_KV_DTYPES
            and not q.is_cuda and q.is_contiguous()
            and _cpu_ops() is not None)


# the caches cpu_decode.cpp reads and writes: every KV_DTYPES one
CPP_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8,
                 torch.uint8)


class PagedStep:
    """One step's paged-attention metadata (slot mapping, block tables, sequence lengths, query
    starts), shared by every layer's write and attend; what the reference path derives from it (the
    real slots, a decode plan per sliding window) is made by the first layer and reused by the rest.
    The runner's attention context and a drafter's cache are PagedSteps."""

    backend = "auto"

    quant_blocks = None   # kivi2: int32 [S], each sequence's quantized blocks (its table's page ids)

    def set_step(self, slot_mapping, block_tables, seq_lens, query_start_loc, quant_blocks=None) -> None:
        self.slot_mapping, self.block_tables, self.seq_lens = slot_mapping, block_tables, seq_lens
        self.query_start_loc, self.quant_blocks = query_start_loc, quant_blocks
        self._kept, self._plans = None, {}

    def write(self, key_cache, value_cache, k, v, kv_dtype="auto", k_scale=1.0, v_scale=1.0,
              k_scale_cache=None, v_scale_cache=None) -> None:
        if self.backend == "torch" and self._kept is None:
            self._kept = reference.real_slots(self.slot_mapping)
        write_kv(key_cache, value_cache, k, v, self.slot_mapping, kv_dtype, k_scale, v_scale, k_scale_cache,
                 v_scale_cache, backend=self.backend, kept=self._kept)

    def attend(self, q, key_cache, value_cache, scale, window, kv_dtype="auto", k_scale=1.0, v_scale=1.0,
               k_scale_cache=None, v_scale_cache=None, pages=None):
        """pages: kivi2's (key_pages, value_pages) of this layer; the caches are its residual."""
        def plan():
            if window not in self._plans:
                self._plans[window] = reference.decode_plan(self.block_tables, self.seq_lens, self.query_start_loc,
                                                            key_cache.shape[1], window, q.device)
            return self._plans[window]

        return paged_attention(q, key_cache, value_cache, self.block_tables, self.seq_lens, self.query_start_loc,
                               scale, window, kv_dtype, k_scale, v_scale, k_scale_cache, v_scale_cache,
                               backend=self.backend, plan=plan,
                               pages=None if pages is None else (*pages, self.quant_blocks))


def rms_norm(x, weight, eps, *, backend: str):
    """RMSNorm over the last dim (float32 statistics, cast back, times weight)."""
    return _impl(backend, x, "triton_norm").rms_norm(x, weight, eps)


def rotary(q, k, cos, sin, *, backend: str):
    """Rotate-half RoPE on q [N, Hq, D], k [N, Hkv, D] with cos/sin [N, D]; returns (q, k)."""
    return _impl(backend, q, "triton_norm").rotary(q, k, cos, sin)


def w4a16_matmul(x, qweight, scales, zeros, group_size, bits=4):
    """Group-wise W4A16/W8A16 dequantize-GEMM (Triton; layout in llmopt/kernels/w4a16.py)."""
    from llmopt.kernels.w4a16 import w4a16_matmul as impl   # deferred: optional dependency (Triton)
    return impl(x, qweight, scales, zeros, group_size, bits)


__all__ = ["BACKENDS", "KV_DTYPES", "PagedStep", "kv_block_bytes", "kv_cache_torch_dtype", "kv_head_width",
           "paged_attention", "resolve_backend", "rms_norm", "rotary", "w4a16_matmul", "write_kv"]
