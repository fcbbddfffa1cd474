"""W4A16 (and W8A16) dequantize-GEMM in Triton: y = x @ dequant(W)ᵀ with group-wise integer weights.

Weight layout (the one llmopt.layers.modules repacks every format into, GPTQ's qweight order):
  qweight int32 [K / (32 / bits), N]: word (r, n) holds the codes of input rows r*8 .. r*8+7
                                     (4-bit) of output column n, lowest bits first;
  scales  [G, N] float, zeros [G, N] float (the integer zero points), group g = k // group_size;
  W[n, k] = (code - zero) * scale.
Two kernels:
  - GEMM (tensor cores through tl.dot) for prefill-sized M, split over K when M·N tiles are few;
  - GEMV for a few rows (decode): each program dequantizes a [BLOCK_K, BLOCK_N] tile once and
    reduces it against every row in registers (no tl.dot padding to 16 rows), split over K so that a
    single token still spreads over all SMs. Split-K partial sums go to an fp32 buffer summed after.
Tested on the CPU under TRITON_INTERPRET=1 against the PyTorch reference `w4a16_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 4


# Only builtins inside the kernels (no tl.sum / tl.cdiv / tl.zeros, which are jit functions of triton's
# standard library): the interpreter cannot call those when triton was imported before
# TRITON_INTERPRET=1 was set, as happens when another package imports it first. A reduce with the
# standard sum combiner is what tl.sum does, and the interpreter runs it as numpy's sum.
_SUM = tl.standard._sum_combine


@triton.jit
def _dequant_tile(q_ptr, s_ptr, z_ptr, k0, offs_k, offs_n, K, N, group_size, stride_qk, stride_sg,
                  BITS: tl.constexpr, ALIGNED: tl.constexpr):
    """Codes of rows offs_k and columns offs_n, dequantized to fp32 [BLOCK_K, BLOCK_N]. ALIGNED: the
    tile lies inside one group (group_size % BLOCK_K == 0), so one row of scales and zeros serves it."""
    PER: tl.constexpr = 32 // BITS
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    words = tl.load(q_ptr + (offs_k[:, None] // PER) * stride_qk + offs_n[None, :], mask=mask, other=0)
    codes = (words >> ((offs_k[:, None] % PER) * BITS)) & ((1 << BITS) - 1)
    if ALIGNED:
        sz_off = (k0 // group_size) * stride_sg + offs_n[None, :]
        sz_mask = offs_n[None, :] < N
    else:
        sz_off = (offs_k[:, None] // group_size) * stride_sg + offs_n[None, :]
        sz_mask = mask
    s = tl.load(s_ptr + sz_off, mask=sz_mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + sz_off, mask=sz_mask, other=0.0).to(tl.float32)
    return (codes.to(tl.float32) - z) * s


@triton.jit
def _gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, group_size,
                 stride_xm, stride_qk, stride_sg, stride_ys, stride_ym,
                 BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, ALIGNED: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for kt in range(pid_k, (K + BLOCK_K - 1) // BLOCK_K, SPLIT_K):
        offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        w = _dequant_tile(q_ptr, s_ptr, z_ptr, kt * BLOCK_K, offs_k, offs_n, K, N, group_size, stride_qk, stride_sg,
                          BITS, ALIGNED)
        if x.dtype == tl.float32:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    y = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, group_size,
                 stride_xm, stride_qk, stride_sg, stride_ys, stride_ym,
                 BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, ALIGNED: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS)
    acc = tl.full((ROWS, BLOCK_N), 0.0, tl.float32)
    for kt in range(pid_k, (K + BLOCK_K - 1) // BLOCK_K, SPLIT_K):
        offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        w = _dequant_tile(q_ptr, s_ptr, z_ptr, kt * BLOCK_K, offs_k, offs_n, K, N, group_size, stride_qk, stride_sg,
                          BITS, ALIGNED)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.reduce(x[:, :, None] * w[None, :, :], 1, _SUM)
    y = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bits: int = 4, gemv: bool | None = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) @ dequant(qweight)ᵀ -> [M, N] in x.dtype. `gemv` forces a path
    (default: GEMV for M <= GEMV_MAX_ROWS)."""
    M, K = x.shape
    N = qweight.shape[1]
    if qweight.shape[0] * (32 // bits) != K:
        raise ValueError(f"qweight {tuple(qweight.shape)} does not hold {K} {bits}-bit input rows")
    x, qweight, scales, zeros = x.contiguous(), qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    use_gemv = M <= GEMV_MAX_ROWS if gemv is None else gemv
    sms = sm_count(x.device)
    if use_gemv:
        rows = max(1, triton.next_power_of_2(M))
        block_n, block_k = 64, max(16, 128 // rows)
        tiles = triton.cdiv(N, block_n)
    else:
        block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
        block_n, block_k = 64, 32
        tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    if group_size % block_k and group_size < block_k and group_size >= 16 and group_size & (group_size - 1) == 0:
        block_k = group_size            # tiles inside one group: one row of scales per tile
    aligned = group_size % block_k == 0
    k_tiles = triton.cdiv(K, block_k)
    split_k = max(1, min(k_tiles, (2 * sms) // max(tiles, 1), 16))
    out = torch.empty((split_k, M, N), device=x.device, dtype=torch.float32)
    args = (x, qweight, scales, zeros, out, M, N, K, group_size, x.stride(0), qweight.stride(0), scales.stride(0),
            out.stride(0), out.stride(1))
    if use_gemv:
        _gemv_kernel[(triton.cdiv(N, block_n), split_k)](*args, BITS=bits, ROWS=rows, BLOCK_N=block_n,
                                                         BLOCK_K=block_k, SPLIT_K=split_k, ALIGNED=aligned)
    else:
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), split_k)
        _gemm_kernel[grid](*args, BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                           ALIGNED=aligned)
    y = out[0] if split_k == 1 else out.sum(0)
    return y.to(x.dtype)


def w4a16_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, bits: int = 4) -> torch.Tensor:
    """The same product in PyTorch (float32 dequantization, then a float32 matmul)."""
    per = 32 // bits
    K = qweight.shape[0] * per
    shifts = torch.arange(per, device=qweight.device, dtype=torch.int32) * bits
    codes = ((qweight[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)).reshape(K, -1)
    g = torch.arange(K, device=qweight.device) // group_size
    w = (codes.float() - zeros.float()[g]) * scales.float()[g]
    return (x.float() @ w).to(x.dtype)
