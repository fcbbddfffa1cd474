"""GGML's block formats (the tensors of a GGUF file) as plain structs, decoded into the grouped
integer form the CPU kernels multiply: w = codes * scale - szero, per group of `gs` columns.

Every format below maps onto that form exactly (its block scale, and its minimum or implied zero
point, are fp16 numbers times small integers, exact in float32), so a GGUF layer runs on the CPU
kernels of llmopt.kernels.cpu_quant with no float copy of the weight, its codes held at their bits
(4, 5, 6 and 8). Layouts follow ggml-common.h: each struct is one block of a row.

| type | values a block | code bits | group | w                         |
|------|---------------:|----------:|------:|---------------------------|
| Q4_0 |             32 |         4 |    32 | (q - 8) * d               |
| Q4_1 |             32 |         4 |    32 | q * d + m                 |
| Q5_0 |             32 |         5 |    32 | (q - 16) * d              |
| Q5_1 |             32 |         5 |    32 | q * d + m                 |
| Q8_0 |             32 |  8 signed |    32 | q * d                     |
| Q4_K |            256 |         4 |    32 | q * d * sc - dmin * mn    |
| Q5_K |            256 |         5 |    32 | q * d * sc - dmin * mn    |
| Q6_K |            256 |         6 |    16 | (q - 32) * d * sc         |
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmopt.ggml_types import BITS, IMPLIED_ZERO
from llmopt.kernels import cpu_quant

_F16 = "<f2"
BLOCKS = {   # type name -> one block as a numpy struct (field order and sizes as ggml-common.h)
    "Q4_0": np.dtype([("d", _F16), ("qs", "u1", 16)]),
    "Q4_1": np.dtype([("d", _F16), ("m", _F16), ("qs", "u1", 16)]),
    "Q5_0": np.dtype([("d", _F16), ("qh", "u1", 4), ("qs", "u1", 16)]),
    "Q5_1": np.dtype([("d", _F16), ("m", _F16), ("qh", "u1", 4), ("qs", "u1", 16)]),
    "Q8_0": np.dtype([("d", _F16), ("qs", "i1", 32)]),
    "Q4_K": np.dtype([("d", _F16), ("dmin", _F16), ("scales", "u1", 12), ("qs", "u1", 128)]),
    "Q5_K": np.dtype([("d", _F16), ("dmin", _F16), ("scales", "u1", 12), ("qh", "u1", 32), ("qs", "u1", 128)]),
    "Q6_K": np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", _F16)]),
}


@dataclass
class GroupedCodes:
    """W [rows, cols] = codes * scales - szeros per group of `group_size` columns; codes uint8 in
    [0, 2**bits) (Q8_0's int8), or with `packed` in the CPU kernels' layout for their bits
    (llmopt.kernels.cpu_quant.pack_codes: 4-bit codes two a byte, Q4_K's quants as stored; 5- and
    6-bit ones as those nibbles and their high bits, cpu_quant.pack_hb); scales float32 [rows,
    cols / gs], or a K-quant's as the file holds them (its sub-scales and fp16 d per row:
    cpu_quant.group_scales); szeros like them, or empty (no zero point), or one zero code z for
    every group, sz = z * scales (Q4_0's 8, Q5_0's 16, Q6_K's 32, as llama.cpp: from the file's d
    alone; cpu_quant.zero_term)."""

    codes: torch.Tensor
    scales: torch.Tensor
    szeros: torch.Tensor
    bits: int
    group_size: int
    packed: bool = False

    @property
    def kind(self) -> str:
        """The layout the CPU kernels hold the codes in (cpu_quant.KINDS)."""
        return cpu_quant.packed_kind(self.bits, self.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        rows, width = self.codes.shape
        return rows, width * 8 // self.bits if self.packed else width

    def unpacked(self) -> torch.Tensor:
        """The codes [rows, cols], a byte each."""
        return cpu_quant.unpack(self.kind, self.codes) if self.packed else self.codes

    def kernel_codes(self) -> torch.Tensor:
        """The codes in the CPU kernels' layout (self.kind)."""
        return self.codes if self.packed else cpu_quant.pack_codes(self.codes, self.kind)

    @property
    def groups(self) -> int:
        return self.shape[1] // self.group_size

    def float_scales(self) -> torch.Tensor:
        """float32 [rows, groups]."""
        return cpu_quant.group_scales(self.scales, self.groups)

    def float_szeros(self) -> torch.Tensor | None:
        """float32 [rows, groups], or None (no zero point)."""
        return cpu_quant.zero_term(self.scales, self.szeros, self.groups)

    def dequantize(self) -> torch.Tensor:
        return cpu_quant.grouped_weight(self.unpacked(), self.scales, self.szeros, self.group_size)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _f32(a: np.ndarray) -> torch.Tensor:
    return _t(a.astype(np.float32))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles are values 0-15, the high ones 16-31."""
    return np.concatenate((qs & 0xF, qs >> 4), axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 4 bytes (a little-endian uint32) -> bit j of value j, [..., 32], as << 4."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits << 4


ROWS_AT_ONCE = 256   # rows decoded at a time into a packed layout (bounds the temporaries)


def _by_rows(b: np.ndarray, width: int, fill) -> torch.Tensor:
    """uint8 [rows, width], fill(blocks of some rows) giving those rows' bytes a few rows at a time."""
    out = np.empty((b.shape[0], width), np.uint8)
    for r in range(0, b.shape[0], ROWS_AT_ONCE):
        part = b[r:r + ROWS_AT_ONCE]
        out[r:r + part.shape[0]] = fill(part).reshape(part.shape[0], width)
    return torch.from_numpy(out)


def _hb(nib: np.ndarray, high: np.ndarray, bits: int) -> np.ndarray:
    """pack_hb's layout from the int4 nibbles [..., 32] and the high bits [..., 64] of 64-column blocks."""
    fields = cpu_quant.high_fields(torch.from_numpy(high), bits).numpy()
    return np.concatenate((nib, fields), axis=-1)


def _hb_q5(b: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 blocks [rows, blocks] (blocks even) -> pack_hb's layout: per pair of blocks (64
    columns) the int4 layout's nibbles; bit j of a block's qh (little-endian) is its column j's bit 4."""
    rows, blocks = b.shape
    nib = _packed_nibbles(b["qs"]).reshape(rows, blocks // 2, 32)
    high = np.unpackbits(b["qh"], axis=-1, bitorder="little").reshape(rows, blocks // 2, 64)
    return _hb(nib, high, 5)


def _hb_q5_k(b: np.ndarray) -> np.ndarray:
    """Q5_K -> pack_hb's layout: its 4 chunks of 64 values are already the int4 layout; chunk c's
    value l (l < 32) takes bit 2c of qh[l], value 32 + l bit 2c + 1."""
    rows, blocks = b.shape
    shift = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)                      # [chunk, half, 1]
    high = (b["qh"][:, :, None, None, :] >> shift) & 1                        # [.., chunk, half, l]
    return _hb(b["qs"].reshape(rows, blocks, 4, 32), high.reshape(rows, blocks, 4, 64), 5)


def _hb_q6_k(b: np.ndarray) -> np.ndarray:
    """Q6_K -> pack_hb's layout. In each half of 128 values, value 32k + l takes ql[l + 32 (k & 1)]'s
    low (k < 2) or high nibble and bits 2k, 2k + 1 of qh[l]: its first 64 values (k = 0, 1) are the
    low nibbles, its next 64 the high ones."""
    rows, blocks = b.shape
    ql = b["ql"].reshape(rows, blocks, 2, 2, 32)              # [.., half, k & 1, l]
    lo, hi = ql[:, :, :, 0], ql[:, :, :, 1]
    nib = np.stack(((lo & 0xF) | (hi << 4), (lo >> 4) | (hi & 0xF0)), axis=3)    # [.., half, chunk, 32]
    shift = (2 * np.arange(4, dtype=np.uint8)).reshape(2, 2, 1)                 # [chunk, k & 1, 1]
    high = (b["qh"].reshape(rows, blocks, 2, 1, 1, 32) >> shift) & 3           # [.., half, chunk, k & 1, l]
    return _hb(nib, high.reshape(rows, blocks, 2, 2, 64), 6)


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> the 8 sub-blocks' 6-bit scales and mins (ggml's get_scale_min_k4)."""
    sc = sc.astype(np.uint8)
    lo_s, lo_m = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    hi_s = (sc[..., 8:12] & 0xF) | ((sc[..., 0:4] >> 6) << 4)
    hi_m = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return np.concatenate((lo_s, hi_s), -1), np.concatenate((lo_m, hi_m), -1)


def _packed_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1 quants [rows, blocks, 16] (blocks even) straight into pack_int4's layout [rows,
    blocks * 16]: per pair of blocks A, B (64 columns), byte j < 16 holds columns j and 32 + j (A's
    and B's low nibbles), byte 16 + j columns 16 + j and 48 + j (their high nibbles). One temporary
    of a quarter of the codes' bytes: no byte-a-code copy of the tensor."""
    rows, blocks, _ = qs.shape
    pair = qs.reshape(rows, blocks // 2, 2, 16)
    a, b = pair[:, :, 0], pair[:, :, 1]
    out = np.empty((rows, blocks // 2, 32), np.uint8)
    tmp = np.empty((rows, blocks // 2, 16), np.uint8)
    np.bitwise_and(a, 0xF, out=out[..., :16])
    np.bitwise_and(b, 0xF, out=tmp)
    np.left_shift(tmp, 4, out=tmp)
    np.bitwise_or(out[..., :16], tmp, out=out[..., :16])
    np.right_shift(a, 4, out=out[..., 16:])
    np.bitwise_and(b, 0xF0, out=tmp)
    np.bitwise_or(out[..., 16:], tmp, out=out[..., 16:])
    return out.reshape(rows, blocks * 16)


def decode(type_name: str, raw: np.ndarray, cols: int, pack: bool = False) -> GroupedCodes:
    """A tensor's rows of blocks (uint8 [rows, bytes a row], e.g. a GGUFReader tensor's data) as
    grouped codes [rows, cols]; `pack`: codes of 4 to 6 bits of a width that is a multiple of 64 come
    straight in the CPU kernels' layout (GroupedCodes.packed), never a byte a code."""
    if type_name not in BLOCKS:
        raise ValueError(f"GGML type {type_name} has no grouped-integer decoder")
    rows, bits = raw.shape[0], BITS[type_name]
    b = np.ascontiguousarray(raw).reshape(rows, -1).view(BLOCKS[type_name])   # [rows, blocks]
    d = b["d"].astype(np.float32)
    zero_code = torch.tensor([float(IMPLIED_ZERO[type_name])]) if type_name in IMPLIED_ZERO else None
    packable = cpu_quant.packed_kind(bits, cols) != "w8"
    if type_name == "Q8_0":
        return GroupedCodes(_t(b["qs"].reshape(rows, cols)), _f32(d), torch.empty(0), 8, 32)
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        szero = _f32(-b["m"]) if type_name.endswith("_1") else zero_code
        if pack and packable:
            codes = torch.from_numpy(_packed_nibbles(b["qs"])) if bits == 4 else _by_rows(b, cols * 5 // 8, _hb_q5)
            return GroupedCodes(codes, _f32(d), szero, bits, 32, packed=True)
        q = _nibbles(b["qs"])
        if bits == 5:
            q = q | _high_bits(b["qh"])
        return GroupedCodes(_t(q.reshape(rows, cols)), _f32(d), szero, bits, 32)
    if type_name in ("Q4_K", "Q5_K"):   # (widths of whole 256-value super-blocks: always packable)
        sc, mn = _k_scales(b["scales"])
        scales, szeros = _sub_scales(sc, b["d"]), _sub_scales(mn, b["dmin"])
        if type_name == "Q4_K":   # its 4 chunks of 64 values, low then high nibbles: the int4 layout
            codes = _t(b["qs"].reshape(rows, cols // 2))
        else:
            codes = _by_rows(b, cols * 5 // 8, _hb_q5_k)
        g = GroupedCodes(codes, scales, szeros, bits, 32, packed=True)
    else:   # Q6_K
        g = GroupedCodes(_by_rows(b, cols * 6 // 8, _hb_q6_k), _sub_scales(b["scales"], b["d"]), zero_code, 6, 16,
                         packed=True)
    return g if pack else GroupedCodes(g.unpacked(), g.scales, g.szeros, g.bits, g.group_size)


def _sub_scales(sub: np.ndarray, d: np.ndarray) -> torch.Tensor:
    """A K-quant's group scales as the file holds them (cpu_quant.group_scales' layout): per row, the
    sub-scales [blocks, per] (uint8; int8 for Q6_K's signed ones) then the fp16 super-block scales."""
    rows = sub.shape[0]
    raw = np.concatenate((np.ascontiguousarray(sub).reshape(rows, -1).view(np.uint8),
                          np.ascontiguousarray(d).view(np.uint8).reshape(rows, -1)), axis=1)
    return _t(raw.view(sub.dtype))
