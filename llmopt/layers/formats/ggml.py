"""GGML's block formats (the tensors of a GGUF file) as plain structs, decoded into the grouped
integer form the CPU kernels multiply: w = codes * scale - szero, per group of `gs` columns.

Every format below maps onto that form exactly (its block scale, and its minimum or implied zero
point, are fp16 numbers times small integers, exact in float32), so a GGUF layer runs on the int4
tiles (4-bit codes) or the int8 tiles (5, 6 and 8-bit codes) of llmopt.kernels.cpu_quant with no
float copy of the weight. Layouts follow ggml-common.h: each struct is one block of a row.

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
    [0, 2**bits), or int8 (Q8_0's, and those of Q5_0 and Q6_K with their implied zero taken off,
    szeros then empty), or with `packed` 4-bit codes in the int4 kernels' nibble layout
    (llmopt.kernels.cpu_quant.pack_int4: uint8 [rows, cols / 2]: Q4_K's quants as stored); scales
    float32 [rows, cols / gs], or a K-quant's as the file holds them (its sub-scales and fp16 d per
    row: cpu_quant.group_scales); szeros like them, or empty (no zero point), or one zero code z for
    every group, sz = z * scales (Q4_0's 8, as llama.cpp: from the file's d alone;
    cpu_quant.zero_term)."""

    codes: torch.Tensor
    scales: torch.Tensor
    szeros: torch.Tensor
    bits: int
    group_size: int
    packed: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        rows, width = self.codes.shape
        return rows, width * 2 if self.packed else width

    def unpacked(self) -> torch.Tensor:
        """The codes [rows, cols], a byte each."""
        return cpu_quant.unpack_int4(self.codes) if self.packed else self.codes

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
    grouped codes [rows, cols]; `pack`: 4-bit codes (Q4_0, Q4_1) of a width that is a multiple of 64
    come straight in the int4 kernels' packed layout."""
    if type_name not in BLOCKS:
        raise ValueError(f"GGML type {type_name} has no grouped-integer decoder")
    rows = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(rows, -1).view(BLOCKS[type_name])   # [rows, blocks]
    d = b["d"].astype(np.float32)
    empty = torch.empty(0)
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        szero = _f32(-b["m"]) if type_name.endswith("_1") else torch.tensor([float(IMPLIED_ZERO.get(type_name, 0))])
        if pack and type_name.startswith("Q4") and cols % 64 == 0:
            return GroupedCodes(_t(_packed_nibbles(b["qs"])), _f32(d), szero, 4, 32, packed=True)
        q = _nibbles(b["qs"])
        if type_name.startswith("Q5"):
            q = q | _high_bits(b["qh"])
        if type_name == "Q5_0":
            q, szero = _signed(q, type_name), empty
        return GroupedCodes(_t(q.reshape(rows, cols)), _f32(d), szero, BITS[type_name], 32)
    if type_name == "Q8_0":
        return GroupedCodes(_t(b["qs"].reshape(rows, cols)), _f32(d), empty, 8, 32)
    if type_name in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(b["scales"])
        scales, szeros = _sub_scales(sc, b["d"]), _sub_scales(mn, b["dmin"])
        if pack and type_name == "Q4_K":   # its 4 chunks of 64 values, low then high nibbles: the int4 layout
            return GroupedCodes(_t(b["qs"].reshape(rows, cols // 2)), scales, szeros, 4, 32, packed=True)
        qs = b["qs"].reshape(rows, -1, 4, 32)              # 4 chunks of 64 values: low then high nibbles
        q = np.stack((qs & 0xF, qs >> 4), axis=3)          # [rows, blocks, chunk, half, 32]
        if type_name == "Q5_K":                            # bit 2j (low half) and 2j + 1 (high) of qh
            qh = b["qh"][:, :, None, None, :]
            shift = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)[None, None, :, :, None]
            q = q | (((qh >> shift) & 1) << 4)
        return GroupedCodes(_t(q.reshape(rows, cols)), scales, szeros, BITS[type_name], 32)
    # Q6_K: two halves of 128 values; in each, value 32k + l takes ql[l + 32 (k & 1)]'s low (k < 2)
    # or high nibble and bits 2k, 2k + 1 of qh[l]
    ql = b["ql"].reshape(rows, -1, 2, 2, 32)               # [rows, blocks, half, k & 1, l]
    qh = b["qh"].reshape(rows, -1, 2, 1, 32)
    lo = np.concatenate((ql & 0xF, ql >> 4), axis=3)       # k = 0, 1, 2, 3
    shift = (2 * np.arange(4)).astype(np.uint8)[None, None, None, :, None]
    q = lo | (((qh >> shift) & 3) << 4)
    return GroupedCodes(_t(_signed(q, "Q6_K").reshape(rows, cols)), _sub_scales(b["scales"], b["d"]), empty, 6, 16)


def _signed(q: np.ndarray, type_name: str) -> np.ndarray:
    """Codes of a type whose zero point is implied (IMPLIED_ZERO) with it taken off: int8 q - z."""
    return q.view(np.int8) - np.int8(IMPLIED_ZERO[type_name])


def _sub_scales(sub: np.ndarray, d: np.ndarray) -> torch.Tensor:
    """A K-quant's group scales as the file holds them (cpu_quant.group_scales' layout): per row, the
    sub-scales [blocks, per] (uint8; int8 for Q6_K's signed ones) then the fp16 super-block scales."""
    rows = sub.shape[0]
    raw = np.concatenate((np.ascontiguousarray(sub).reshape(rows, -1).view(np.uint8),
                          np.ascontiguousarray(d).view(np.uint8).reshape(rows, -1)), axis=1)
    return _t(raw.view(sub.dtype))
