"""The C++ quantized CPU kernels' tiling (llmopt/kernels/cpu_quant_tiles.h) called directly: ragged
row counts (not a multiple of the 4-row tile) and every M tile (1, 2, 3, 4 and mixes) against a
float64 reference, and each output element independent of the tiling, bit for bit: a slice of the
weight's rows, or one row of x, gives the same numbers as the whole call (what fused q/k/v rely on).
Float weights read their rows one at a time for few rows of x (row_f32): the same bits as the
4-row tiles, so a verified draft's logits are plain decoding's."""

from __future__ import annotations

import pytest
import torch

from llmopt.kernels import cpu_quant
from llmopt.quant.formats import pack_linear
from llmopt.layers.modules import GPTQLinear
from llmopt.layers.types import IntQuantized

K = 384
NS = (1, 5, 7, 193)
MS = (1, 2, 3, 5, 9)



@pytest.fixture(scope="module")
def ops():
    o = cpu_quant.ops()
    assert o is not None, "the quantized CPU kernels did not build (g++ and AVX2 are expected here)"
    return o


def _case(ops, fmt: str, n: int, gs: int, seed: int):
    """(call(x, rows) -> y for the weight's rows `rows`, float64 weight [n, K])."""
    g = torch.Generator().manual_seed(seed)
    G = K // gs
    s = torch.rand(n, G, generator=g) + 0.1
    sz = torch.randn(n, G, generator=g)
    if fmt == "w4":
        q = torch.randint(0, 16, (n, K), generator=g)
        packed = cpu_quant.pack_int4(q)
        w = (q.double().view(n, G, gs) * s.double()[..., None] - sz.double()[..., None]).view(n, K)
        return (lambda x, r: ops.w4_gemm(x, packed[r], s[r], sz[r], gs)), w
    if fmt in ("w5", "w6"):   # stored zeros, or one zero code for every group (w5c, w6c)
        bits = int(fmt[1])
        q = torch.randint(0, 2 ** bits, (n, K), generator=g)
        packed = cpu_quant.pack_hb(q, bits)
        w = (q.double().view(n, G, gs) * s.double()[..., None] - sz.double()[..., None]).view(n, K)
        return (lambda x, r: ops.wh_gemm(x, packed[r], s[r], sz[r], gs, bits)), w
    if fmt in ("w5c", "w6c"):
        bits = int(fmt[1])
        q = torch.randint(0, 2 ** bits, (n, K), generator=g)
        packed, z = cpu_quant.pack_hb(q, bits), torch.tensor([2.0 ** (bits - 1)])
        w = ((q.double() - float(z)).view(n, G, gs) * s.double()[..., None]).view(n, K)
        return (lambda x, r: ops.wh_gemm(x, packed[r], s[r], z, gs, bits)), w
    if fmt == "f8":
        f = torch.randn(n, K, generator=g).to(torch.float8_e4m3fn)
        sf = s[:, 0].contiguous()
        return (lambda x, r: ops.f8_gemm(x, f.view(torch.uint8)[r], sf[r])), f.double() * sf.double()[:, None]
    c = torch.randint(-128, 128, (n, K), generator=g, dtype=torch.int8)
    z = sz if fmt == "w8z" else torch.empty(0)
    w = c.double().view(n, G, gs) * s.double()[..., None]
    if z.numel():
        w = w - z.double()[..., None]
    return (lambda x, r: ops.w8_gemm(x, c[r], s[r], z[r] if z.numel() else z, gs)), w.view(n, K)


@pytest.mark.parametrize("fmt,gs", [("w8", K), ("w8z", 32), ("w8z", 128), ("w4", 32), ("w4", 64), ("w4", 128),
                                    ("w5", 32), ("w5c", 64), ("w6", 128), ("w6c", 16), ("f8", K)])
def test_ragged_rows_and_every_m_tile(ops, fmt, gs):
    for n in NS:
        call, w = _case(ops, fmt, n, gs, seed=n)
        everything = slice(0, n)
        for m in MS:
            x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
            y = call(x, everything)
            ref = x.double() @ w.t()
            bound = 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-6
            assert bool(((y.double() - ref).abs() <= bound).all()), (fmt, gs, n, m)
            if n > 3:       # a slice of rows off the 4-row grid, and one row of x: the same bits
                assert torch.equal(call(x, slice(1, n - 1)), y[:, 1:n - 1])
            assert torch.equal(call(x[m - 1:].contiguous(), everything), y[m - 1:])


def test_int4_group_off_the_64_column_blocks_uses_int8_codes(ops):
    """4-bit groups of 96 columns straddle the nibble layout's 64-column blocks: the module keeps
    int8 codes instead (w8 kernel), with the same numbers."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (32, K), generator=g, dtype=torch.int32)
    s = (torch.rand(32, K // 96, generator=g) * 0.1 + 0.01).half().float()
    qt = IntQuantized(qweight=q, scales=s, zeros=torch.full((32, K // 96), 8, dtype=torch.int32), bits=4,
                      group_size=96, sym=True)
    mod = GPTQLinear(K, 32, False, bits=4, group_size=96, sym=True)
    for name, t in pack_linear("m", qt, "gptq").items():
        mod._buffers[name.rpartition(".")[2]] = t
    mod.finish_loading()
    assert mod._cpu == ("w8", 96)
    x = torch.randn(3, K, generator=g)
    w = qt.dequantize(torch.float64)
    assert torch.allclose(mod(x).double(), x.double() @ w.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="int4 group size"):
        ops.w4_gemm(x, cpu_quant.pack_int4(q.remainder(16)), s, torch.empty(0), 96)


@pytest.mark.parametrize("k", [8, 40, 200, 576, 1536])
def test_float_rows_streamed_or_tiled_give_the_same_bits(ops, k):
    """f32_gemm for 1-10 rows of x, weight rows streamed one at a time for up to tiles_config's
    f32_stream rows (1, 2, 4, 8) or through the tiles (0): within float32 rounding of a float64
    product, and the same bits whichever path, and row by row as in one call; no rows, no output."""
    from llmopt import defaults
    g = torch.Generator().manual_seed(k)
    try:
        for n in (1, 7, 193):
            w = torch.randn(n, k, generator=g)
            for m in range(1, 11):
                x = torch.randn(m, k, generator=g)
                ref = x.double() @ w.double().t()
                bound = 1e-6 * (x.double().abs() @ w.double().abs().t()) + 1e-7
                ops.tiles_config(-1, 0, 0, 0)
                tiled = ops.f32_gemm(x, w)
                assert bool(((tiled.double() - ref).abs() <= bound).all()), (n, m)
                for stream in (1, 2, 4, 8):
                    ops.tiles_config(-1, 0, 0, stream)
                    assert torch.equal(ops.f32_gemm(x, w), tiled), (n, m, stream)
                    rows = torch.cat([ops.f32_gemm(x[i:i + 1].contiguous(), w) for i in range(m)])
                    assert torch.equal(rows, tiled), (n, m, stream)
            assert ops.f32_gemm(torch.empty(0, k), w).shape == (0, n)   # a step that scores no row
        with pytest.raises(RuntimeError, match="f32_stream"):
            ops.tiles_config(-1, 0, 0, 9)
    finally:
        ops.tiles_config(-1, 0, 0, defaults.CPU_F32_STREAM_MAX_ROWS)


def test_float32_many_rows_within_rounding_and_the_same_bits_at_any_tiling(ops):
    """f32_gemm from f32_panel_rows (32) rows up (the float panels): within float32 rounding of a
    float64 product for widths off the 8-column vectors and weight rows off the 16-row panels; each
    row's output the same bits at any row count, and each output column's for any slice of the
    weight's rows (fused q/k/v and gate/up)."""
    g = torch.Generator().manual_seed(32)
    for n, k in ((1, 8), (7, 40), (9, 200), (193, 576), (40, 1544)):
        w = torch.randn(n, k, generator=g)
        x = torch.randn(70, k, generator=g)
        full = ops.f32_gemm(x, w)
        ref = x.double() @ w.double().t()
        bound = 1e-6 * (x.double().abs() @ w.double().abs().t()) + 1e-7
        assert bool(((full.double() - ref).abs() <= bound).all()), (n, k)
        for m in (32, 33, 34, 64):
            assert torch.equal(ops.f32_gemm(x[:m].contiguous(), w), full[:m]), (n, k, m)
        if n > 3:
            assert torch.equal(ops.f32_gemm(x, w[3:].contiguous()), full[:, 3:]), (n, k)


def test_float32_weights_broadcast_as_stored_give_the_panels_bits(ops):
    """f32_bcast (float32 weights read as stored, x transposed into blocks of 64 rows; from
    f32_panel_rows to tiles_config's f32_bcast rows where the panels are AVX-512) against the float
    panels (f32_bcast 0) on the same call: the same bits for row counts around the 16-row vectors
    and the 64-row blocks and widths off the 6-row tiles and the 24-row thread units; within
    float32 rounding of a float64 product; a row's bits the same whether its step takes the
    broadcast (128 rows) or the panels (200)."""
    from llmopt import defaults
    g = torch.Generator().manual_seed(64)
    try:
        for n, k in ((1, 8), (7, 40), (25, 200), (193, 576), (576, 1536)):
            w = torch.randn(n, k, generator=g)
            x = torch.randn(200, k, generator=g)
            ops.tiles_config(-1, 0, 0, -1, -1, 0)
            panels = ops.f32_gemm(x, w)
            ops.tiles_config(-1, 0, 0, -1, -1, 128)
            assert torch.equal(ops.f32_gemm(x, w), panels), (n, k)   # 200 rows: the panels in both
            ref = x.double() @ w.double().t()
            bound = 1e-6 * (x.double().abs() @ w.double().abs().t()) + 1e-7
            for m in (32, 47, 64, 65, 100, 128):
                y = ops.f32_gemm(x[:m].contiguous(), w)
                assert torch.equal(y, panels[:m]), (n, k, m)
                assert bool(((y.double() - ref[:m]).abs() <= bound[:m]).all()), (n, k, m)
        with pytest.raises(RuntimeError, match="f32_bcast"):
            ops.tiles_config(-1, 0, 0, -1, -1, -2)
    finally:
        ops.tiles_config(-1, 0, 0, -1, -1, defaults.CPU_F32_BCAST_MAX_ROWS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_weights_multiply_as_their_float32_copy(ops, dtype, float32_products):
    """bfloat16 / float16 weights widened inside the loop: for 1, 3, 16 and 64 rows of x (the row
    streamer, the tiles, the panels) and odd widths, the same bits as the float32 copy of the same
    values, and within float32 rounding of a float64 product (bfloat16 panels in float32 products:
    the next test has their AMX / AVX-512 BF16 products)."""
    g = torch.Generator().manual_seed(16)
    for n, k in ((1, 8), (7, 40), (193, 200), (64, 576), (40, 1544)):
        w = torch.randn(n, k, generator=g).to(dtype)
        for m in (1, 3, 16, 64):
            x = torch.randn(m, k, generator=g)
            y = ops.f32_gemm(x, w)
            assert torch.equal(y, ops.f32_gemm(x, w.float())), (n, k, m)
            ref = x.double() @ w.double().t()
            bound = 1e-6 * (x.double().abs() @ w.double().abs().t()) + 1e-7
            assert bool(((y.double() - ref).abs() <= bound).all()), (n, k, m)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.f32_gemm(torch.randn(1, 8), torch.zeros(2, 8, dtype=torch.int8))


def test_bfloat16_panels_take_bfloat16_products_where_the_cpu_has_them(ops):
    """bfloat16 weights times 32 rows of x or more (prefill): with AMX or AVX-512 BF16 (CPUID), x is
    rounded to bfloat16 and the products summed in float32: within float32 rounding of the float64
    product of bf16(x) and W, for odd widths and row counts (padded tiles); each row's output the
    same bits at any row count. Without them, the float32 products (the float32 copy's bits)."""
    from llmopt import defaults
    flags = open("/proc/cpuinfo").read()
    has = "avx512_bf16" in flags and "avx512bw" in flags and "avx512vl" in flags
    g = torch.Generator().manual_seed(3)
    try:
        for n, k in ((1, 8), (49, 200), (193, 40), (64, 576), (40, 1544)):
            w = torch.randn(n, k, generator=g).bfloat16()
            x = torch.randn(70, k, generator=g)
            ops.tiles_config(-1, 0, 0, -1, 0)
            exact = ops.f32_gemm(x, w)
            ops.tiles_config(-1, 0, 0, -1, 1)
            for m in (32, 33, 70):
                y = ops.f32_gemm(x[:m].contiguous(), w)
                assert torch.equal(y, ops.f32_gemm(x, w)[:m]), (n, k, m)   # a row's bits, whatever M
                if not has:
                    assert torch.equal(y, exact[:m])
                    continue
                xb = x[:m].bfloat16().double()
                ref = xb @ w.double().t()
                bound = 1e-6 * (xb.abs() @ w.double().abs().t()) + 1e-7
                assert bool(((y.double() - ref).abs() <= bound).all()), (n, k, m)
                assert not torch.equal(y, exact[:m])   # the rounding of x is real
    finally:
        ops.tiles_config(-1, 0, 0, -1, int(defaults.CPU_BF16_DOT_PRODUCTS))
