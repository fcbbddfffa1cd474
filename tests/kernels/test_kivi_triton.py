"""The Triton paged attention on kivi2 caches (2-bit pages for each sequence's first quant_blocks
blocks, a full-precision residual after them; llmopt/kernels/kivi.py), on the CPU under
TRITON_INTERPRET=1: decode and varlen kernels against a float64 attention over the dequantized rows,
and against the reference path (the kivi2 variants' sm_90 compile: scripts/gpu_check.py --compile,
run by tests/kernels/test_kernels.py; the batches: tests/paged_batch.py).

Page ids and residual ids are drawn from overlapping ranges, so reading a block from the wrong space
reads other data; unused pages and residual slots hold NaN garbage (0x7F bytes: fp16 NaN scales),
which the kernels must never load. TRITON_INTERPRET must be set before a kernel is decorated (see
tests/kernels/test_kernels.py).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from llmopt import kernels  # noqa: E402
from llmopt.errors import UserInputError  # noqa: E402
from llmopt.kernels import reference as ref  # noqa: E402
from llmopt.kernels import triton_attention, triton_attention_kernels  # noqa: E402
from paged_batch import kivi_oracle, make_kivi_batch, run_kivi  # noqa: E402

if not isinstance(triton_attention_kernels._decode_kernel, InterpretedFunction):
    for mod in (triton_attention_kernels, triton_attention):
        importlib.reload(mod)

SCALE = 0.3
F32, BF16 = torch.float32, torch.bfloat16
# (context_len, query_len, quant_blocks): no pages, some, every full block (64 and 32: no residual left)
DECODE32 = [(1, 1, 0), (32, 1, 1), (45, 1, 1), (64, 1, 2), (96, 1, 1), (70, 1, 0), (70, 1, 2)]
DECODE16 = [(1, 1, 0), (16, 1, 1), (40, 1, 2), (48, 1, 3), (33, 1, 0)]
# prefill chunks after a cached prefix (some of it in pages), a whole prefill, decode rows, and queries
# whose own keys sit in pages
MIXED32 = [(40, 8, 1), (64, 64, 0), (1, 1, 0), (70, 1, 2), (96, 20, 2), (64, 10, 2), (50, 18, 0)]
MIXED16 = [(20, 4, 1), (48, 48, 0), (50, 1, 3), (40, 9, 2), (3, 1, 0)]


def _check(specs, hq, hkv, d, g, res_dtype, q_dtype, seed, window=None, **knobs):
    b = make_kivi_batch(specs, hq, hkv, d, g, res_dtype, q_dtype, seed)
    got = run_kivi(triton_attention.paged_attention, b, SCALE, window, **knobs)
    assert got.dtype == q_dtype and torch.isfinite(got).all()
    tol = 2e-2 if q_dtype == BF16 else 1e-5   # bf16: the output's rounding (the interpreter truncates)
    torch.testing.assert_close(got.double(), kivi_oracle(b, SCALE, window), atol=tol, rtol=tol)
    want = run_kivi(ref.paged_attention, make_kivi_batch(specs, hq, hkv, d, g, res_dtype, q_dtype, seed, "big"), SCALE, window)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    return b, got


@pytest.mark.parametrize("hq,hkv,d,g,res_dtype,q_dtype,splits,block_n", [
    (4, 2, 64, 32, F32, F32, 1, None),     # tiles of 16 inside a block
    (4, 2, 64, 32, BF16, F32, 3, 64),      # tiles of 64 straddle two blocks: pages and residual in one tile
    (3, 1, 32, 32, F32, F32, 2, 32),
    (3, 1, 32, 32, BF16, BF16, 1, None),
    (4, 2, 64, 16, F32, F32, 2, None),     # G 16: four value groups per head
])
def test_decode(hq, hkv, d, g, res_dtype, q_dtype, splits, block_n):
    specs = DECODE32 if g == 32 else DECODE16
    _check(specs, hq, hkv, d, g, res_dtype, q_dtype, seed=hq + d + splits, num_splits=splits, block_n=block_n)


@pytest.mark.parametrize("hq,hkv,d,g,res_dtype,q_dtype,block_n", [
    (4, 2, 64, 32, F32, F32, None),
    (3, 1, 32, 32, BF16, F32, 64),
    (4, 2, 32, 32, BF16, BF16, None),
    (3, 1, 64, 16, F32, F32, 32),
])
def test_varlen(hq, hkv, d, g, res_dtype, q_dtype, block_n):
    specs = MIXED32 if g == 32 else MIXED16
    _check(specs, hq, hkv, d, g, res_dtype, q_dtype, seed=hq * d, block_n=block_n)


def test_sliding_window():
    _check(DECODE32, 4, 2, 32, 32, F32, F32, seed=3, window=20, num_splits=2)
    _check(MIXED32[:5], 4, 2, 32, 32, F32, F32, seed=4, window=20, block_n=32)


@pytest.mark.filterwarnings("ignore:All-NaN slice")   # a block misread as a page reads a garbage page
def test_wrong_quant_blocks_are_seen():
    """The checks can fail: one block of one sequence read from the other space gives other rows."""
    b, got = _check(DECODE32[:4], 4, 2, 32, 32, F32, F32, seed=9)
    want = kivi_oracle(b, SCALE)
    for delta in (-1, 1):   # sequence 2 (45 tokens, 1 page): no pages, or its residual block as a page
        qb = b.quant_blocks.clone()
        qb[2] += delta
        wrong = run_kivi(triton_attention.paged_attention, b, SCALE, quant_blocks=qb).double()
        assert not torch.allclose(wrong[2], want[2], atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(wrong[:2], got[:2].double())   # the others unchanged


def test_dispatch_reaches_triton_with_pages(monkeypatch):
    b = make_kivi_batch(MIXED32[:3], 4, 2, 32, 32, seed=5)
    calls = []
    real = triton_attention.paged_attention
    monkeypatch.setattr(triton_attention, "paged_attention", lambda *a, **k: calls.append(k) or real(*a, **k))
    got = run_kivi(lambda *a, **k: kernels.paged_attention(*a, backend="triton", **k), b, SCALE)
    assert len(calls) == 1 and calls[0]["pages"][2] is b.quant_blocks
    torch.testing.assert_close(got.double(), kivi_oracle(b, SCALE), atol=1e-5, rtol=1e-5)


def test_bad_pages_are_refused():
    b = make_kivi_batch(DECODE32[:2], 4, 2, 32, 32, seed=6)
    short = b.key_pages[..., :-4].contiguous()
    with pytest.raises(UserInputError, match="key pages"):
        triton_attention.paged_attention(b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                                         b.query_start_loc, SCALE, None, "kivi2", 1.0, 1.0,
                                         pages=(short, b.value_pages, b.quant_blocks))
    with pytest.raises(UserInputError, match="quant_blocks"):
        run_kivi(triton_attention.paged_attention, b, SCALE, quant_blocks=b.quant_blocks[:1])
