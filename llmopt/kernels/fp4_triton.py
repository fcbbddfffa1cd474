"""4-bit float weights (FP4 E2M1 / NVFP4 / MXFP4, NF4, bitsandbytes' FP4) dequantized inside a Triton
GEMM: y = x @ Wᵀ with W[n, k] = table[code[n, k]] * scales[n, k // block].

Weight layout (llmopt.layers.modules_fp4.Fp4Linear's runtime form, the one the C++ kernels read too):
  codes  uint8 [N, K / 2] in llmopt.kernels.cpu_quant.pack_int4's layout (K % 64 == 0): per 64-column
         block b, byte 32b + j holds column 64b + j in its low nibble and 64b + 32 + j in its high one;
  scales float32 [N, K / block] (block 16, 32 or 64), every scale level of the format multiplied out;
  table  float32 [16], the code set's values (llmopt.layers.formats.fp4.table).
A K-tile (BLOCK_K, a multiple of 64 dividing K) covers whole 64-column blocks, so its codes are BLOCK_K / 2
consecutive bytes of each weight row. The tile is split by nibble instead of being re-interleaved:
byte i of the tile holds, in its low nibble, column k = k0 + 64 (i // 32) + i % 32 (the "lo" half) and, in
its high nibble, column k + 32 (the "hi" half). Each byte is read once; each half is decoded through the
table (tl.load(table_ptr + code): 16 floats, cached), multiplied by its block's scale and reduced against
the matching columns of x, so one tile is two products of depth BLOCK_K / 2.
Two kernels, as in llmopt.kernels.w4a16:
  - GEMM (tensor cores through tl.dot, fp32 accumulation) for prefill-sized M, split over K when the
    M·N tiles are few;
  - GEMV for a few rows (decode): each program decodes a [BLOCK_K, BLOCK_N] tile once and reduces it
    against every row in registers, split over K so one token still spreads over all SMs.
Split-K partial sums go to an fp32 buffer summed after. Tested on the CPU under TRITON_INTERPRET=1
against a float64 product (tests/kernels/test_fp4_triton.py); `fp4_reference` is the PyTorch product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmopt.kernels.w4a16 import sm_count

GEMV_MAX_ROWS = 4
BLOCKS = (16, 32, 64)
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Only builtins inside the kernels (see llmopt.kernels.w4a16): no tl.sum / tl.cdiv / tl.zeros, which the
# interpreter cannot call when triton was imported before TRITON_INTERPRET=1 was set.
_SUM = tl.standard._sum_combine


@triton.jit
def _decode_halves(c_ptr, s_ptr, t_ptr, kt, offs_n, N, stride_cn, stride_sn,
                   BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """K-tile kt of rows offs_n as two fp32 [BLOCK_K / 2, BLOCK_N] halves and the columns of the lo
    half: lo[i] is column k_lo[i] = kt * BLOCK_K + 64 (i // 32) + i % 32 (the low nibble of the tile's
    byte i), hi[i] column k_lo[i] + 32 (its high nibble)."""
    HALF: tl.constexpr = BLOCK_K // 2
    i = tl.arange(0, HALF)
    k_lo = kt * BLOCK_K + (i // 32) * 64 + i % 32
    mask = offs_n[None, :] < N
    rows_c = c_ptr + offs_n[None, :] * stride_cn
    b = tl.load(rows_c + (kt * HALF + i)[:, None], mask=mask, other=0).to(tl.int32)   # [HALF, BLOCK_N]
    lo = tl.load(t_ptr + (b & 15))
    hi = tl.load(t_ptr + (b >> 4))
    rows_s = s_ptr + offs_n[None, :] * stride_sn
    s_lo = tl.load(rows_s + (k_lo // BLOCK)[:, None], mask=mask, other=0.0)
    if BLOCK == 64:   # a 64-column block: both nibbles of a byte share its scale
        s_hi = s_lo
    else:
        s_hi = tl.load(rows_s + ((k_lo + 32) // BLOCK)[:, None], mask=mask, other=0.0)
    return lo * s_lo, hi * s_hi, k_lo


@triton.jit
def _gemm_kernel(x_ptr, c_ptr, s_ptr, t_ptr, y_ptr, M, N, K, stride_xm, stride_cn, stride_sn, stride_ys, stride_ym,
                 BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    x_mask = offs_m[:, None] < M
    for kt in range(pid_k, K // BLOCK_K, SPLIT_K):
        w_lo, w_hi, k_lo = _decode_halves(c_ptr, s_ptr, t_ptr, kt, offs_n, N, stride_cn, stride_sn, BLOCK, BLOCK_K)
        x_lo = tl.load(x_rows + k_lo[None, :], mask=x_mask, other=0.0)
        x_hi = tl.load(x_rows + (k_lo + 32)[None, :], mask=x_mask, other=0.0)
        if x_lo.dtype == tl.float32:
            acc += tl.dot(x_lo, w_lo, input_precision="ieee")
            acc += tl.dot(x_hi, w_hi, input_precision="ieee")
        else:
            acc += tl.dot(x_lo, w_lo.to(x_lo.dtype))
            acc += tl.dot(x_hi, w_hi.to(x_hi.dtype))
    y = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _gemv_kernel(x_ptr, c_ptr, s_ptr, t_ptr, y_ptr, M, N, K, stride_xm, stride_cn, stride_sn, stride_ys, stride_ym,
                 BLOCK: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS)
    acc = tl.full((ROWS, BLOCK_N), 0.0, tl.float32)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    x_mask = offs_m[:, None] < M
    for kt in range(pid_k, K // BLOCK_K, SPLIT_K):
        w_lo, w_hi, k_lo = _decode_halves(c_ptr, s_ptr, t_ptr, kt, offs_n, N, stride_cn, stride_sn, BLOCK, BLOCK_K)
        x_lo = tl.load(x_rows + k_lo[None, :], mask=x_mask, other=0.0).to(tl.float32)
        x_hi = tl.load(x_rows + (k_lo + 32)[None, :], mask=x_mask, other=0.0).to(tl.float32)
        acc += tl.reduce(x_lo[:, :, None] * w_lo[None, :, :], 1, _SUM)
        acc += tl.reduce(x_hi[:, :, None] * w_hi[None, :, :], 1, _SUM)
    y = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _check(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int, table: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in X_DTYPES:
        raise ValueError(f"fp4_matmul: x must be 2-D float16/bfloat16/float32, not {x.dtype} {tuple(x.shape)}")
    K = x.shape[1]
    if block not in BLOCKS:
        raise ValueError(f"fp4_matmul: block {block} is not one of {BLOCKS}")
    if K % 64:
        raise ValueError(f"fp4_matmul: K = {K} is not a multiple of 64 (the nibble layout's blocks)")
    if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] * 2 != K:
        raise ValueError(f"fp4_matmul: codes {codes.dtype} {tuple(codes.shape)} are not uint8 [N, {K // 2}]")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (codes.shape[0], K // block):
        raise ValueError(f"fp4_matmul: scales {scales.dtype} {tuple(scales.shape)} are not float32 "
                         f"[{codes.shape[0]}, {K // block}]")
    if table.dtype != torch.float32 or table.numel() != 16:
        raise ValueError(f"fp4_matmul: table {table.dtype} {tuple(table.shape)} is not 16 float32 values")
    devices = {t.device for t in (x, codes, scales, table)}
    if len(devices) != 1:
        raise ValueError(f"fp4_matmul: x, codes, scales and table are on different devices {sorted(map(str, devices))}")


def fp4_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int, table: torch.Tensor,
               gemv: bool | None = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) @ (table[codes] * scales per block)ᵀ -> [M, N] in x.dtype, accumulated in
    fp32; codes, scales and table as the module docstring says. `gemv` forces a path (default: GEMV for
    M <= GEMV_MAX_ROWS)."""
    _check(x, codes, scales, block, table)
    M, K = x.shape
    N = codes.shape[0]
    x, codes, scales, table = x.contiguous(), codes.contiguous(), scales.contiguous(), table.reshape(16).contiguous()
    use_gemv = M <= GEMV_MAX_ROWS if gemv is None else gemv
    sms = sm_count(x.device)
    if use_gemv:
        rows = max(1, triton.next_power_of_2(M))
        block_n = 64
        block_k = 128 if rows <= 2 and K % 128 == 0 else 64
        tiles = triton.cdiv(N, block_n)
    else:
        block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
        block_n = 64
        block_k = 128 if K % 128 == 0 else 64
        tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    k_tiles = K // block_k
    split_k = max(1, min(k_tiles, (2 * sms) // max(tiles, 1), 16))
    out = torch.empty((split_k, M, N), device=x.device, dtype=torch.float32)
    args = (x, codes, scales, table, out, M, N, K, x.stride(0), codes.stride(0), scales.stride(0),
            out.stride(0), out.stride(1))
    if use_gemv:
        _gemv_kernel[(triton.cdiv(N, block_n), split_k)](*args, BLOCK=block, ROWS=rows, BLOCK_N=block_n,
                                                         BLOCK_K=block_k, SPLIT_K=split_k)
    else:
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), split_k)
        _gemm_kernel[grid](*args, BLOCK=block, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k)
    y = out[0] if split_k == 1 else out.sum(0)
    return y.to(x.dtype)


def fp4_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int,
                  table: torch.Tensor) -> torch.Tensor:
    """The same product in PyTorch (float32 dequantization of the nibble layout, then a float32 matmul)."""
    n, half = codes.shape
    c = codes.reshape(n, half // 32, 1, 32)
    c = torch.cat((c & 15, c >> 4), dim=2).reshape(n, half * 2).long()
    w = (table.float()[c].view(n, -1, block) * scales.float()[..., None]).view(n, half * 2)
    return (x.float() @ w.t()).to(x.dtype)
