"""CPU kernels for quantized weights (cpu_quant.cpp): GEMV/GEMM that decode int8, int4 (grouped
nibble layout), 5- and 6-bit (the nibbles and their high bits) and FP8 weights inside the loop
(and widen bfloat16 / float16 ones: cpu_decode.cpp's f32_gemm), float32 activations and
accumulation.

The C++ file is compiled on first use with torch.utils.cpp_extension (g++, AVX2 + FMA, OpenMP over
output rows), cached under TORCH_EXTENSIONS_DIR or CACHE_DIR/torch_extensions keyed by the source's
hash, and loaded as torch.ops.llmopt_cpu.*, so eager code and torch.compile graphs call the same
ops. Without a compiler (or AVX2) the same functions run in PyTorch, dequantizing a slice of rows
at a time (never the whole weight), after one warning line.

Layouts and the arithmetic: see the header of cpu_quant.cpp; `pack_int4` writes the int4 layout,
`pack_hb` the 5- and 6-bit one; `pack_codes` picks a layout ("kind") for codes of some bits.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from llmopt import defaults

log = logging.getLogger("llmopt.kernels")
SOURCE = Path(__file__).with_name("cpu_quant.cpp")
SOURCES = (SOURCE, SOURCE.with_name("cpu_decode.cpp"))   # one library: the GEMMs and the fused decode layer
HEADERS = tuple(SOURCE.with_name(h) for h in ("cpu_quant_tiles.h", "cpu_idot_tiles.h", "cpu_bf16_panels.h"))
ROWS_PER_SLICE = 4096   # fallback: rows of a weight dequantized at once


def _build_dir() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else defaults.CACHE_DIR / "torch_extensions"


@functools.cache
def available() -> bool:
    """Whether the compiled ops are loaded (builds them on the first call); False after one warning."""
    if os.environ.get("LLMOPT_CPU_KERNELS", "1") == "0":
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.warning("quantized CPU kernels need AVX2: running the PyTorch fallback (slower)")
        return False
    src = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    name = "llmopt_cpu_quant_" + hashlib.sha256(src + torch.__version__.encode()).hexdigest()[:12]
    build = _build_dir() / name
    try:
        from torch.utils import cpp_extension
        build.mkdir(parents=True, exist_ok=True)
        lib = build / f"{name}.so"
        if lib.is_file():
            torch.ops.load_library(str(lib))
        else:
            log.info("building the quantized CPU kernels (once, cached in %s)", build)
            cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], build_directory=str(build),
                               extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=False)
    except Exception as e:   # no compiler, no ninja, a read-only cache...
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        log.warning("cannot build the quantized CPU kernels (%s): running the PyTorch fallback (slower)", first)
        return False
    return hasattr(torch.ops.llmopt_cpu, "w8_gemm")


# -- fake (meta) implementations, for torch.compile's tracing -----------------------------------
def _register_fakes() -> None:
    def out(x, n):
        return x.new_empty((x.shape[0], n))

    torch.library.register_fake("llmopt_cpu::w8_gemm")(lambda x, codes, s, sz, gs: out(x, codes.shape[0]))
    torch.library.register_fake("llmopt_cpu::w4_gemm")(lambda x, packed, s, sz, gs: out(x, packed.shape[0]))
    torch.library.register_fake("llmopt_cpu::wh_gemm")(lambda x, packed, s, sz, gs, bits: out(x, packed.shape[0]))
    torch.library.register_fake("llmopt_cpu::f8_gemm")(lambda x, codes, s: out(x, codes.shape[0]))
    torch.library.register_fake("llmopt_cpu::f32_gemm")(lambda x, w: out(x, w.shape[0]))
    torch.library.register_fake("llmopt_cpu::fp4_gemm")(lambda x, codes, s, gs, kind: out(x, codes.shape[0]))
    torch.library.register_fake("llmopt_cpu::w8_rows")(
        lambda ids, codes, s: s.new_empty((ids.numel(), codes.shape[1])))


_OPS: list = []   # [torch.ops.llmopt_cpu or None] once resolved: a plain global that torch.compile reads


def ops():
    """torch.ops.llmopt_cpu, or None when the fallback runs. Resolved once, eagerly (a graph being
    compiled only reads _OPS: dynamo cannot trace the build or the CPU capability query)."""
    if not _OPS:
        if available():
            _register_fakes()
            torch.ops.llmopt_cpu.tiles_config(-1, defaults.CPU_IDOT_PANEL_MIN_ROWS, defaults.CPU_F32_PANEL_MIN_ROWS,
                                              defaults.CPU_F32_STREAM_MAX_ROWS, int(defaults.CPU_BF16_DOT_PRODUCTS),
                                              defaults.CPU_F32_BCAST_MAX_ROWS)
            _OPS.append(torch.ops.llmopt_cpu)
        else:
            _OPS.append(None)
    return _OPS[0]


# -- layouts --------------------------------------------------------------------------------------
def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in [0, 16) (K a multiple of 64) -> uint8 [N, K / 2]: per 64-column block b, byte
    32b + j holds column 64b + j (low nibble) and 64b + 32 + j (high nibble)."""
    n, k = codes.shape
    c = codes.to(torch.uint8).contiguous()
    if c.device.type == "cpu":   # numpy's uint8 shifts: ~10x torch's on the CPU (model load time)
        a = c.numpy().reshape(n, k // 64, 2, 32)
        return torch.from_numpy((a[:, :, 0] | (a[:, :, 1] << 4)).reshape(n, k // 2))
    c = c.view(n, k // 64, 2, 32)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    if packed.device.type == "cpu":
        a = packed.contiguous().numpy().reshape(n, half // 32, 1, 32)
        return torch.from_numpy(np.concatenate((a & 0xF, a >> 4), axis=2).reshape(n, half * 2))
    p = packed.view(n, half // 32, 32)
    return torch.stack((p & 0xF, p >> 4), dim=2).reshape(n, half * 2)


def _field_shifts(p: int) -> torch.Tensor:
    """[8 / p, 1]: where each of a byte's fields of p bits starts."""
    return (p * torch.arange(8 // p, dtype=torch.uint8)).view(-1, 1)


def high_fields(high: torch.Tensor, bits: int) -> torch.Tensor:
    """The high bits (code >> 4) of 64-column blocks [..., 64] -> pack_hb's 8P bytes [..., 8P] (P =
    bits - 4): column c's in field c // 8P (P bits at bit P (c // 8P)) of byte c % 8P."""
    p = bits - 4
    h = high.to(torch.uint8).reshape(*high.shape[:-1], 8 // p, 8 * p)
    return (h << _field_shifts(p)).sum(-2, dtype=torch.uint8)   # (fields apart: the sum is their OR)


def pack_hb(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [N, K] in [0, 2**bits), bits 5 or 6 (K a multiple of 64) -> uint8 [N, K * bits / 8]: per
    64-column block the int4 layout's 32 bytes (pack_int4), then the high bits' 8 (bits - 4) bytes
    (high_fields)."""
    n, k = codes.shape
    c = codes.to(torch.uint8).view(n, k // 64, 64)
    nib = pack_int4(c.reshape(n, k) & 0xF).view(n, k // 64, 32)
    return torch.cat([nib, high_fields(c >> 4, bits)], dim=2).reshape(n, k * bits // 8).contiguous()


def unpack_hb(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """pack_hb's inverse: uint8 codes [N, K]."""
    n, width = packed.shape
    p, blocks = bits - 4, width // (8 * bits)
    b = packed.view(n, blocks, 8 * bits)
    codes = unpack_int4(b[:, :, :32].reshape(n, blocks * 32)).view(n, blocks, 64)
    high = (b[:, :, None, 32:] >> _field_shifts(p)) & ((1 << p) - 1)     # [n, blocks, field, byte]
    return (codes | (high.reshape(n, blocks, 64) << 4)).reshape(n, blocks * 64)


# the kernels' layouts of grouped codes: kind -> (bits a code, cpu_decode.cpp's Kind)
KINDS = {"w8": (8, 1), "w4": (4, 2), "w5": (5, 6), "w6": (6, 7)}


def packed_kind(bits: int, width: int) -> str:
    """The layout codes of `bits` (at most 8) and `width` columns are held in: 4 to 6 bits at their
    bits where the width is a multiple of 64, else a byte a code."""
    return f"w{bits}" if 4 <= bits <= 6 and width % 64 == 0 else "w8"


def pack_codes(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """Unsigned codes [N, K] (int8 ones for "w8", as given) in `kind`'s layout."""
    bits = KINDS[kind][0]
    if kind == "w8":
        return codes.to(torch.int8).contiguous()
    return pack_int4(codes) if bits == 4 else pack_hb(codes, bits)


def unpack(kind: str, packed: torch.Tensor) -> torch.Tensor:
    """Codes [N, K], a byte each, of a layer held in `kind`'s layout."""
    bits = KINDS[kind][0]
    return packed if kind == "w8" else unpack_int4(packed) if bits == 4 else unpack_hb(packed, bits)


# -- the entry points -----------------------------------------------------------------------------
def sliced_matmul(x: torch.Tensor, n: int, dequant) -> torch.Tensor:
    """x @ W^T for W [n, K] made by dequant(a, b) (its rows a..b) a slice of ROWS_PER_SLICE rows at a
    time: the fallback that never holds the whole float weight."""
    y = x.new_empty((x.shape[0], n))
    for r in range(0, n, ROWS_PER_SLICE):
        w = dequant(r, min(n, r + ROWS_PER_SLICE))
        y[:, r:r + w.shape[0]] = F.linear(x, w)
    return y


K_SCALE_DTYPES = (torch.uint8, torch.int8)


def group_scales(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Float32 [N, G] of what a layer holds as group scales (or scaled zeros): float32 / float16 as
    they are; a K-quant's as its GGUF holds them (uint8 sub-scales, int8 where signed, [N, G + 2 G /
    per]: a row's G sub-scales, then its fp16 super-block scales, one per `per` groups) multiplied
    out, exact in float32 (the kernels' KScales)."""
    if t.dtype not in K_SCALE_DTYPES:
        return t.float()
    sub, sup = t[:, :groups].float(), t[:, groups:].contiguous().view(torch.float16).float()
    return sub * sup.repeat_interleave(groups // sup.shape[1], dim=1)


def group_columns(t: torch.Tensor, groups: int, g0: int, g1: int) -> torch.Tensor:
    """Groups g0..g1 of every row of scales or scaled zeros as a layer holds them (float [N, G], or
    K-quant sub-scales with their super-block scales: g0 and g1 then whole super-blocks)."""
    if t.dtype not in K_SCALE_DTYPES:
        return t[:, g0:g1].contiguous()
    per = groups // ((t.shape[1] - groups) // 2)
    if g0 % per or g1 % per:
        raise ValueError(f"groups {g0}..{g1} are not whole super-blocks of {per}")
    return torch.cat([t[:, g0:g1], t[:, groups + 2 * (g0 // per):groups + 2 * (g1 // per)]], dim=1).contiguous()


def is_zero_code(szeros: torch.Tensor) -> bool:
    """One zero code z for every group (a 1-d tensor [1]; stored scaled zeros are [N, G])."""
    return szeros.dim() == 1 and szeros.numel() == 1


def zero_term(scales: torch.Tensor, szeros: torch.Tensor, groups: int) -> torch.Tensor | None:
    """The kernels' scaled zero points [N, G] (float32) from what a layer holds: stored ones (float
    or K-quant sub-scales, group_scales); one zero code z the same for every group (llama.cpp's
    Q4_0, Q5_0 and Q6_K, held as the file holds them): z * the scales; empty: None (no zero point)."""
    if is_zero_code(szeros):
        return szeros.float() * group_scales(scales, groups)
    return group_scales(szeros, groups) if szeros.numel() else None


def _rows(szeros: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return szeros if szeros.dim() == 1 else szeros[a:b]   # (one zero code or none: every row's)


def grouped_weight(codes: torch.Tensor, scales, szeros, gs: int) -> torch.Tensor:
    """Float32 W [N, K] = codes * s - sz per group of gs columns (codes unpacked [N, K])."""
    n, k = codes.shape
    w = codes.float().view(n, k // gs, gs) * group_scales(scales, k // gs)[..., None]
    z = zero_term(scales, szeros, k // gs)
    if z is not None:
        w = w - z[..., None]
    return w.view(n, k)


def _kernel(x: torch.Tensor):
    """The compiled ops for this many rows of x, or None: past CPU_QUANT_KERNEL_MAX_ROWS a slice of the
    weight dequantized at a time and the float GEMM (multi-threaded BLAS) are faster."""
    return ops() if x.shape[0] <= defaults.CPU_QUANT_KERNEL_MAX_ROWS else None


def w8_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, szeros: torch.Tensor, gs: int):
    """x [M, K] float32 @ ((codes - z) * s)^T; codes int8 [N, K]; scales [N, K / gs] float32 or
    float16 (or K-quant sub-scales: group_scales); szeros s * z like them, or empty, or one zero code
    z (zero_term)."""
    o = _kernel(x)
    if o is not None:
        return o.w8_gemm(x, codes, scales, szeros, gs)
    return sliced_matmul(x, codes.shape[0], lambda a, b: grouped_weight(codes[a:b], scales[a:b], _rows(szeros, a, b), gs))


def w4_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, szeros: torch.Tensor, gs: int):
    """x [M, K] float32 @ ((q - z) * s)^T with q from pack_int4's layout [N, K / 2]."""
    o = _kernel(x)
    if o is not None:
        return o.w4_gemm(x, packed, scales, szeros, gs)
    return sliced_matmul(x, packed.shape[0], lambda a, b: grouped_weight(unpack_int4(packed[a:b]), scales[a:b],
                                                             _rows(szeros, a, b), gs))


def wh_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, szeros: torch.Tensor, gs: int, bits: int):
    """x [M, K] float32 @ ((q - z) * s)^T with q from pack_hb's layout of `bits` [N, K * bits / 8]."""
    o = _kernel(x)
    if o is not None:
        return o.wh_gemm(x, packed, scales, szeros, gs, bits)
    return sliced_matmul(x, packed.shape[0], lambda a, b: grouped_weight(unpack_hb(packed[a:b], bits), scales[a:b],
                                                             _rows(szeros, a, b), gs))


def grouped_gemm(kind: str, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, szeros: torch.Tensor,
                 gs: int) -> torch.Tensor:
    """x @ W^T for a layer held in `kind`'s layout (KINDS)."""
    if kind == "w4":
        return w4_gemm(x, packed, scales, szeros, gs)
    if kind == "w8":
        return w8_gemm(x, packed, scales, szeros, gs)
    return wh_gemm(x, packed, scales, szeros, gs, KINDS[kind][0])


def f8_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor):
    """x [M, K] float32 @ (fp8(codes) * s)^T; codes: float8_e4m3fn bytes as uint8 [N, K]; s [N] or [1]."""
    o = _kernel(x)
    if o is not None:
        return o.f8_gemm(x, codes, scales)
    s = scales.reshape(-1, 1)
    return sliced_matmul(x, codes.shape[0], lambda a, b: codes[a:b].view(torch.float8_e4m3fn).float()
                   * (s[a:b] if s.shape[0] > 1 else s))


# 4-bit float codes: llmopt/layers/formats/fp4.py's table names -> cpu_decode.cpp's Kind
FP4_KINDS = {"e2m1": 8, "nf4": 9, "bnb_fp4": 10}


def fp4_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int,
             table_name: str) -> torch.Tensor | None:
    """x [M, K] float32 @ (table[codes] * scale of the block)^T, the codes decoded inside the loop;
    codes uint8 [N, K / 2] in pack_int4's layout, scales float32 [N, K / block]. None where the
    kernels do not run (no compiled ops, or more rows than CPU_QUANT_KERNEL_MAX_ROWS: the caller's
    dequantized slices and BLAS)."""
    o = _kernel(x)
    return None if o is None else o.fp4_gemm(x, codes, scales, block, FP4_KINDS[table_name])


def w8_rows(ids: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an int8 table times their scales [V]: [ids.numel(), K] float32."""
    o = ops()
    if o is not None:
        return o.w8_rows(ids, codes, scales)
    flat = ids.reshape(-1)
    return codes[flat].float() * scales[flat, None]


def linear_2d(x: torch.Tensor, fn, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Run `fn(x2d_float32) -> [M, N]` over x [..., K] and add the bias, in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    y = fn(x2)
    if bias is not None:
        y = y + bias.float()
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y.view(*x.shape[:-1], out_features)   # (no-op dispatches skipped: this runs ~120 times a token)
