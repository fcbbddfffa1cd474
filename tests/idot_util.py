"""The C++ integer tiles' paths (AVX2; AVX-512 VNNI tiles and panels where the CPU has them: the
`idot_path` fixture of conftest.py sets one) and the float64 reference of their int8 activations."""

from __future__ import annotations

import torch

from llmopt.kernels import cpu_quant


def _has_vnni() -> bool:
    ops = cpu_quant.ops()
    if ops is None:
        return False
    try:
        ops.tiles_config(1)
        return True
    except RuntimeError:
        return False
    finally:
        ops.tiles_config(-1)


# the integer kernels: (instruction set, linears of at least this many rows as panels)
IDOT_PATHS = {"avx2-tiles": (0, 10**6)}
if _has_vnni():
    IDOT_PATHS |= {"vnni-tiles": (1, 10**6), "vnni-panels": (1, 1)}


def quantize_x(x: torch.Tensor) -> torch.Tensor:
    """Per 32 columns: q = round(x * 127 / max|x|) (float32 products, half to even), as float64 q * d."""
    b = x.view(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(b * inv)
    return (q.double() * (amax / 127).double()).view_as(x)
