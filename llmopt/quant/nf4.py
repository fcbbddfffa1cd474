"""bitsandbytes 4-bit quantization (NF4, FP4), optionally double quantized, into the form
transformers saves (llmopt.layers.formats.bnb describes it; llmopt.quant.formats.bnb writes it).

Per block of `block` consecutive values of W.flatten() (each inside one row: in % block == 0):
- the block's absmax is its scale; double quantized, the absmax vector minus its mean (the offset)
  is itself quantized to 8 bits against bitsandbytes' signed dynamic map in blocks of 256, each by
  its own absmax (float32);
- each weight takes the code whose table value v makes v * scale nearest to it, where scale is the
  block's scale as it will be stored (after double quantization), so the checkpoint dequantizes to
  exactly the values these codes were chosen for. Ties go to the lower value, as bitsandbytes'
  bucketize over the midpoints does (bitsandbytes itself chooses codes against the unquantized absmax).
"""

from __future__ import annotations

import torch

from llmopt.errors import UserInputError
from llmopt.layers.formats.bnb import BLOCKSIZES, NESTED_BLOCKSIZE, QUANT_TYPES, BnbQuantized
from llmopt.layers.formats.fp4 import table

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (create_dynamic_map(signed=True)), float32 [256] ascending:
    0, 1 and, for e = 0..6, the midpoints of 2**e equal steps of [0.1, 1] times 10**(e - 6), each
    with both signs (float32 arithmetic: float32 endpoints, midpoints and products)."""
    values = [0.0, 1.0]
    for e in range(7):
        edges = torch.linspace(0.1, 1.0, 2 ** e + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2 * (10.0 ** (e - 6))
        values += mids.tolist() + (-mids).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


def quantize(w: torch.Tensor, block: int = 64, quant_type: str = "nf4", double_quant: bool = True) -> BnbQuantized:
    """W [out, in] float -> bitsandbytes' stored form (bias None: the caller sets it)."""
    _check(w, block, quant_type)
    out, n_in = w.shape
    blocks = w.detach().to(torch.float32).reshape(-1, block)          # [nb, block], nb = out * in / block
    absmax = blocks.abs().amax(dim=1)
    dtype = w.dtype if w.dtype in _DTYPES else torch.float32
    q = BnbQuantized(weight=torch.empty(0, dtype=torch.uint8), absmax=absmax, quant_map=table(QUANT_TYPES[quant_type]),
                     quant_type=quant_type, blocksize=block, shape=(out, n_in), dtype=dtype)
    if double_quant:
        offset = absmax.mean()
        q.absmax, q.nested_absmax = quantize_blockwise(absmax - offset, dynamic_map(), NESTED_BLOCKSIZE)
        q.nested_quant_map, q.nested_offset = dynamic_map(), offset.item()
    q.weight = pack_nibbles(nearest_codes(blocks, q.scales(), q.table_name))
    return q


def _check(w: torch.Tensor, block: int, quant_type: str) -> None:
    if quant_type not in QUANT_TYPES:
        raise UserInputError(f"unknown bitsandbytes quant_type {quant_type!r}: use nf4 or fp4")
    if block not in BLOCKSIZES:
        raise UserInputError(f"bitsandbytes block size {block} is not one of {', '.join(map(str, BLOCKSIZES))}")
    if w.dim() != 2 or not w.is_floating_point():
        raise UserInputError(f"bitsandbytes 4-bit quantizes a float [out, in] weight, got {w.dtype} {tuple(w.shape)}")
    if w.shape[1] % block:
        raise UserInputError(f"block size {block} does not divide the weight's {w.shape[1]} input features")


def quantize_blockwise(x: torch.Tensor, code: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [m] -> (uint8 [m] nearest codes into the ascending `code` of x / absmax, float32
    [ceil(m / blocksize)] absmax of each block of `blocksize`)."""
    m = x.numel()
    padded = torch.zeros(-(-m // blocksize) * blocksize, dtype=torch.float32)
    padded[:m] = x
    amax = padded.view(-1, blocksize).abs().amax(dim=1)
    scaled = (padded.view(-1, blocksize) * (1.0 / amax.clamp(min=1e-38))[:, None]).clamp(-1, 1).reshape(-1)[:m]
    return torch.bucketize(scaled, (code[:-1] + code[1:]) / 2).to(torch.uint8), amax


def nearest_codes(blocks: torch.Tensor, scales: torch.Tensor, table_name: str) -> torch.Tensor:
    """blocks float32 [nb, B], scales float32 [nb] -> uint8 [nb * B]: for each value the code of the
    nearest table value times its block's scale (a zero scale: the code of 0). Of equal table values
    (FP4's 0 and -0) the lower code."""
    values = table(table_name)
    order = sorted(range(16), key=lambda c: (values[c].item(), c))
    distinct = [c for i, c in enumerate(order) if i == 0 or values[c] != values[order[i - 1]]]
    sorted_values = values[distinct]
    inv = torch.where(scales != 0, 1.0 / torch.where(scales != 0, scales, 1.0), 0.0)
    scaled = (blocks * inv[:, None]).clamp(-1, 1).reshape(-1)
    idx = torch.bucketize(scaled, (sorted_values[:-1] + sorted_values[1:]) / 2)
    return torch.tensor(distinct, dtype=torch.uint8).index_select(0, idx)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [n] -> uint8 [ceil(n / 2), 1]: codes[2i] in the high nibble, codes[2i + 1] in the low."""
    flat = codes.reshape(-1).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat((flat, flat.new_zeros(1)))
    return ((flat[0::2] << 4) | flat[1::2]).reshape(-1, 1)
