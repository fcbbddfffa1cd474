"""Bit packing of integer codes into int32 words, the one primitive every packed format shares.

A word holds `32 // bits` consecutive codes along one dimension, lowest bits first. `order` lets a
format interleave them (AutoAWQ GEMM writes code `order[i]` of each run of 8 into bit field i).
`pad=True` pads a dimension that is not a multiple of the run length with zero codes
(compressed-tensors packs densely with ceil(n * bits / 32) words).
"""

from __future__ import annotations

from typing import Sequence

import torch

from llmopt.errors import UserInputError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def codes_per_word(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise UserInputError(f"{bits}-bit codes cannot be packed into int32 words by this format: use 2, 4 or 8 bits")
    return 32 // bits


def pack_codes(codes: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None,
               pad: bool = False) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) along `dim` into int32 words."""
    per = codes_per_word(bits)
    c = codes.to(torch.int64).movedim(dim, -1)
    n = c.shape[-1]
    if n % per:
        if not pad:
            raise UserInputError(f"a dimension of {n} cannot be packed {per} codes per int32 word")
        c = torch.nn.functional.pad(c, (0, per - n % per))
    if bool(((c < 0) | (c >= 1 << bits)).any()):
        raise UserInputError(f"codes outside [0, {1 << bits}) cannot be packed in {bits} bits")
    c = c.reshape(*c.shape[:-1], -1, per)
    if order is not None:
        c = c[..., list(order)]
    shifts = torch.arange(per, dtype=torch.int64, device=c.device) * bits
    words = (c << shifts).sum(-1)                       # disjoint bit fields: the sum is the OR
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def unpack_codes(words: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None,
                 count: int | None = None) -> torch.Tensor:
    """Inverse of pack_codes: int32 words -> int32 codes along `dim` (the first `count` of them)."""
    per = codes_per_word(bits)
    w = words.to(torch.int32).movedim(dim, -1)
    shifts = torch.arange(per, dtype=torch.int32, device=w.device) * bits
    fields = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)   # [..., n_words, per]: bit field i
    if order is not None:                                      # (the mask drops the sign the shift drags in)
        inverse = sorted(range(per), key=lambda i: order[i])    # code j sits in field inverse[j]
        fields = fields[..., inverse]
    codes = fields.flatten(-2)
    if count is not None:
        codes = codes[..., :count]
    return codes.movedim(-1, dim)


def default_groups(in_features: int, group_size: int) -> torch.Tensor:
    gs = in_features if group_size == -1 else group_size
    return torch.arange(in_features, dtype=torch.int32) // gs


def has_trivial_groups(g_idx: torch.Tensor | None, in_features: int, group_size: int) -> bool:
    """Whether g_idx is the plain column // group_size (what formats without g_idx assume)."""
    if g_idx is None:
        return True
    return bool(torch.equal(g_idx.to(torch.int32).cpu(), default_groups(in_features, group_size)))
