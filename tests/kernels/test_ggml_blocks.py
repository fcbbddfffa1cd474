"""GGML's block formats as the CPU kernels run them (llmopt.layers.formats.ggml, GGMLLinear):
decoded exactly as the gguf package's own dequantizers decode them, multiplied equal to a float64
product of those dequantized weights (float activations: within float32 rounding; int8
activations: equal to the float64 product of the quantized activations), for M = 1, 3, 16, 64 and
widths of odd block counts. Tensors are quantized by the gguf package's reference quantizers, or
(K-quants, which it cannot quantize) random blocks of sane scales."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gguf_util import ggml_bytes
from idot_util import IDOT_PATHS, quantize_x
from llmopt import defaults
from llmopt.kernels import cpu_quant
from llmopt.ggml_types import IMPLIED_ZERO, RUN_TYPES, held_bytes
from llmopt.layers.formats.ggml import BLOCKS, decode
from llmopt.layers.modules_ggml import GGMLEmbedding, GGMLLinear

pytestmark = pytest.mark.skipif(cpu_quant.ops() is None, reason="needs the C++ kernels (g++, AVX2)")

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# (type, in_features): 576 = 9 x 64 (int4 tiles), 352 = 11 x 32 (4-bit codes on the int8 tiles), 768 = 3 x 256
SHAPES = [(t, k) for t in RUN_TYPES if t not in K_QUANTS for k in (576, 352)] + [(t, 768) for t in K_QUANTS]


def _tensor(type_name: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """(the blocks, the gguf package's dequantization of them as float64 [n, k])."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.2
    raw = ggml_bytes(w, type_name, seed)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return raw, torch.from_numpy(np.asarray(ref, dtype=np.float64)).reshape(n, k)


def test_every_run_type_has_its_block_struct_of_ggml_size():
    assert tuple(BLOCKS) == RUN_TYPES
    for name, struct in BLOCKS.items():
        assert struct.itemsize == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][1]


@pytest.mark.parametrize("type_name,k", SHAPES)
def test_decode_equals_the_gguf_dequantizers(type_name, k):
    raw, ref = _tensor(type_name, 7, k)
    g = decode(type_name, raw, k)
    assert g.codes.shape == (7, k)
    assert int(g.codes.min()) >= (-127 if type_name == "Q8_0" else 0)
    assert int(g.codes.max()) < (128 if type_name == "Q8_0" else 2 ** g.bits)
    if type_name in IMPLIED_ZERO:   # one zero code, as the file: d alone
        assert g.szeros.tolist() == [IMPLIED_ZERO[type_name]]
    assert torch.equal(g.dequantize().double(), ref)
    lin = GGMLLinear(g, type_name)
    assert lin._cpu[0] == (f"w{g.bits}" if g.bits <= 6 and k % 64 == 0 else "w8")
    assert torch.equal(lin.dequantized().double(), ref)
    held = sum(b.numel() * b.element_size() for b in lin.buffers())
    assert held == held_bytes(type_name, (7, k))           # what kv-estimate counts for it


@pytest.mark.parametrize("type_name,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_float_activations_equal_float64_of_the_dequantized_weight(type_name, k, m):
    raw, ref = _tensor(type_name, 43, k, seed=m)   # 43 rows: a partial tile
    lin = GGMLLinear(decode(type_name, raw, k), type_name)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = lin(x)
    want = x.double() @ ref.t()
    assert y.dtype == torch.float32 and y.shape == (m, 43)
    assert float((y.double() - want).abs().max() / want.abs().max()) <= 2e-6


@pytest.mark.parametrize("idot_path", list(IDOT_PATHS), indirect=True)
@pytest.mark.parametrize("type_name", RUN_TYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_int8_activations_equal_float64_of_the_quantized_activations(idot_path, type_name, m):
    """(Q6_K's groups of 16: the integer tiles and panels sum each half of a 32-column block apart.)"""
    k = 768 if type_name in K_QUANTS else 576
    raw, ref = _tensor(type_name, 43, k, seed=m)
    lin = GGMLLinear(decode(type_name, raw, k), type_name)
    kind, gs = lin._cpu
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    y = torch.ops.llmopt_cpu.idot_gemm(x, lin.cpu_codes, lin.cpu_scales, lin.cpu_szeros, gs,
                                       cpu_quant.KINDS[kind][1])
    exact = x.double() @ ref.t()
    if idot_path == "avx2-tiles" and m >= defaults.CPU_F32_PANEL_MIN_ROWS:   # without VNNI: the float panels
        assert float((y.double() - exact).abs().max() / exact.abs().max()) <= 2e-6
        return
    want = quantize_x(x) @ ref.t()
    assert float((y.double() - want).abs().max() / want.abs().max()) <= 2e-6
    assert float((exact - want).abs().max() / want.abs().max()) > 1e-4   # the rounding is real


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q6_K"])
def test_embedding_rows_are_the_dequantized_rows(type_name):
    k = 768 if type_name in K_QUANTS else 576
    raw, ref = _tensor(type_name, 50, k)
    table = GGMLLinear(decode(type_name, raw, k), type_name)
    emb = GGMLEmbedding(table, torch.float32, owner=True)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(emb(ids).double(), ref[ids])
    assert [n for n, _ in emb.named_buffers()] == ["own.cpu_codes", "own.cpu_scales", "own.cpu_szeros"]


@pytest.mark.parametrize("idot_path", list(IDOT_PATHS), indirect=True)
@pytest.mark.parametrize("type_name,k", [("Q4_1", 352), ("Q4_0", 576), ("Q8_0", 352)])
@pytest.mark.parametrize("m", [1, 2, 16])
def test_fp16_scales_as_stored_give_the_float32_scales_results(idot_path, type_name, k, m):
    """Q4_x / Q5_x / Q8_0 layers hold the file's fp16 d and m: the int8-activation tiles and panels
    give bit for bit what float32 copies of them give, the float tiles the same within float32
    rounding (the compiler orders the zero-point sums of the two loops differently), the scales also
    read from a view that starts mid-word (an odd fp16 offset) and an odd count of them (43 rows x
    11 groups: the last one read alone)."""
    raw, _ = _tensor(type_name, 43, k, seed=m)
    lin = GGMLLinear(decode(type_name, raw, k), type_name)
    assert lin.cpu_scales.dtype == torch.float16
    kind, gs = lin._cpu
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3

    def odd(t):   # the same values in a view at an odd fp16 offset
        return torch.cat([t.new_zeros(1), t.flatten()])[1:].view_as(t) if t.numel() else t

    s32, z32 = lin.cpu_scales.float(), lin.cpu_szeros.float()
    for scales, szeros in ((lin.cpu_scales, lin.cpu_szeros), (odd(lin.cpu_scales), odd(lin.cpu_szeros))):
        got = torch.ops.llmopt_cpu.idot_gemm(x, lin.cpu_codes, scales, szeros, gs, cpu_quant.KINDS[kind][1])
        want = torch.ops.llmopt_cpu.idot_gemm(x, lin.cpu_codes, s32, z32, gs, cpu_quant.KINDS[kind][1])
        assert torch.equal(got, want)
        y16 = cpu_quant.grouped_gemm(kind, x, lin.cpu_codes, scales, szeros, gs)
        y32 = cpu_quant.grouped_gemm(kind, x, lin.cpu_codes, s32, z32, gs)
        assert float((y16 - y32).abs().max()) <= 1e-6 * float(y32.abs().max())


@pytest.mark.parametrize("type_name,k", [("Q4_0", 576), ("Q4_0", 1024), ("Q4_1", 576), ("Q4_K", 768),
                                         ("Q5_0", 576), ("Q5_1", 1024), ("Q5_K", 768), ("Q6_K", 768)])
def test_blocks_decode_straight_into_the_kernels_layout(type_name, k):
    """At load, codes of 4 to 6 bits go straight into the CPU kernels' packed layout (no byte-a-code
    copy; Q4_K's quants are the int4 layout as stored): the same
    bytes pack_int4 / pack_hb make of the codes, which unpack to them, the same layer, and q/k's row
    unpermutation moves packed rows as it moves codes."""
    from llmopt.ggml_types import BITS
    bits = BITS[type_name]
    raw, ref = _tensor(type_name, 12, k)
    plain, packed = decode(type_name, raw, k), decode(type_name, raw, k, pack=True)
    assert packed.packed and packed.shape == (12, k) and packed.codes.shape == (12, k * bits // 8)
    want = cpu_quant.pack_int4(plain.codes) if bits == 4 else cpu_quant.pack_hb(plain.codes, bits)
    assert torch.equal(packed.codes, want)
    assert torch.equal(cpu_quant.unpack(f"w{bits}", want), plain.codes)
    assert torch.equal(packed.unpacked(), plain.codes) and torch.equal(packed.dequantize().double(), ref)
    a, b = GGMLLinear(plain, type_name), GGMLLinear(packed, type_name)
    assert all(torch.equal(x, y) for x, y in zip(a.buffers(), b.buffers()))
    from llmopt.models.gguf_weights import unpermute_rope
    assert torch.equal(cpu_quant.unpack(f"w{bits}", unpermute_rope(packed.codes, 3)), unpermute_rope(plain.codes, 3))


def test_high_bits_are_held_in_fields_of_consecutive_bytes():
    """pack_hb's layout by its definition: per 64 columns the int4 nibbles (low: column j, high:
    column 32 + j), then 8P bytes (P = bits - 4): column c's high bits are field c // 8P of byte c % 8P."""
    codes = torch.zeros(1, 64, dtype=torch.uint8)
    codes[0, 3], codes[0, 40], codes[0, 33] = 0b010111, 0b100001, 0b110000
    p = cpu_quant.pack_hb(codes, 6)[0]
    assert p.shape == (48,) and p[3] == 0x7 and p[8] == 0x1 << 4 and p[1] == 0
    # 6 bits: column 3 -> byte 3, bits 0-1 = 1; column 33 -> byte 1, bits 4-5 = 3; column 40 -> byte 8, bits 4-5 = 2
    assert p[32:].tolist() == [0, 3 << 4, 0, 1, 0, 0, 0, 0, 2 << 4, 0, 0, 0, 0, 0, 0, 0]
    p5 = cpu_quant.pack_hb(codes & 31, 5)[0]
    # 5 bits: column 3 -> byte 3, bit 0; column 33 -> byte 1, bit 4 (column 40's bit 4 is 0)
    assert p5.shape == (40,) and p5[32:].tolist() == [0, 1 << 4, 0, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("idot_path", list(IDOT_PATHS), indirect=True)
@pytest.mark.parametrize("kind", ["w4", "w8"])
@pytest.mark.parametrize("m", [1, 2, 16, 64])
def test_an_implied_zero_code_gives_what_stored_zeros_give(idot_path, kind, m):
    """Q4_0 packed two a byte holds d alone, its zero point one code (8) for every group, as the file
    does: the int8-activation tiles and panels give bit for bit what a stored zero per group (the fp16
    8 d, exact) gives, the float tiles the same within float32 rounding (as the fp16 scales' test), in
    float16 and float32 scales; and the same codes a byte each (int8 kernels)."""
    raw, _ = _tensor("Q4_0", 43, 576, seed=m)
    lin = GGMLLinear(decode("Q4_0", raw, 576, pack=True), "Q4_0")
    gs = lin._cpu[1]
    assert lin._cpu[0] == "w4" and lin.cpu_szeros.shape == (1,) and float(lin.cpu_szeros) == 8
    codes = lin.cpu_codes if kind == "w4" else cpu_quant.unpack_int4(lin.cpu_codes).to(torch.int8)
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m)) * 3
    fn = cpu_quant.w4_gemm if kind == "w4" else cpu_quant.w8_gemm
    for scales in (lin.cpu_scales, lin.cpu_scales.float()):
        stored = (lin.cpu_szeros.float() * scales.float()).to(scales.dtype)
        for z in (lin.cpu_szeros, lin.cpu_szeros.float()):
            z = z.to(scales.dtype)
            got = torch.ops.llmopt_cpu.idot_gemm(x, codes, scales, z, gs, cpu_quant.KINDS[kind][1])
            want = torch.ops.llmopt_cpu.idot_gemm(x, codes, scales, stored, gs, cpu_quant.KINDS[kind][1])
            assert torch.equal(got, want)
            y, y_stored = fn(x, codes, scales, z, gs), fn(x, codes, scales, stored, gs)
            assert float((y - y_stored).abs().max()) <= 1e-6 * float(y_stored.abs().max())


def test_an_implied_zero_code_is_refused_where_it_cannot_hold():
    codes = torch.zeros(4, 64, dtype=torch.int8)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="must not be 0"):
        torch.ops.llmopt_cpu.w8_gemm(x, codes, torch.ones(4, 2), torch.zeros(1), 32)
    with pytest.raises(RuntimeError, match="needs scales"):
        torch.ops.llmopt_cpu.idot_gemm(x, codes, torch.ones(1), torch.ones(1), 64, 1)


@pytest.mark.parametrize("idot_path", list(IDOT_PATHS), indirect=True)
@pytest.mark.parametrize("type_name", K_QUANTS)
@pytest.mark.parametrize("m", [1, 2, 16, 64])
def test_k_quant_scales_as_stored_give_the_float32_scales_results(idot_path, type_name, m):
    """A K-quant layer holds its file's byte sub-scales and fp16 d / dmin per 256 (Q6_K: signed
    sub-scales, its codes signed with the implied 32 taken off): the int8-activation tiles and panels give bit
    for bit what float32 copies of the multiplied-out scales give, the float paths the same within
    float32 rounding, and the Python fallback multiplies them out the same way."""
    k = 768
    raw, ref = _tensor(type_name, 43, k, seed=m)
    lin = GGMLLinear(decode(type_name, raw, k, pack=True), type_name)
    kind, gs = lin._cpu
    assert lin.cpu_scales.dtype == (torch.int8 if type_name == "Q6_K" else torch.uint8)
    assert lin.cpu_scales.shape == (43, k // gs + 2 * k // 256)
    s32 = cpu_quant.group_scales(lin.cpu_scales, k // gs)
    # (Q6_K: its zero code, taken off its codes in the int8-activation kernels, with either scales)
    z32 = lin.cpu_szeros if cpu_quant.is_zero_code(lin.cpu_szeros) else \
        cpu_quant.zero_term(lin.cpu_scales, lin.cpu_szeros, k // gs)
    assert torch.equal(cpu_quant.grouped_weight(cpu_quant.unpack(kind, lin.cpu_codes), s32, z32, gs).double(), ref)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    got = torch.ops.llmopt_cpu.idot_gemm(x, lin.cpu_codes, lin.cpu_scales, lin.cpu_szeros, gs, cpu_quant.KINDS[kind][1])
    want = torch.ops.llmopt_cpu.idot_gemm(x, lin.cpu_codes, s32, z32, gs, cpu_quant.KINDS[kind][1])
    assert torch.equal(got, want)
    y = cpu_quant.grouped_gemm(kind, x, lin.cpu_codes, lin.cpu_scales, lin.cpu_szeros, gs)
    y32 = cpu_quant.grouped_gemm(kind, x, lin.cpu_codes, s32, z32, gs)
    assert float((y - y32).abs().max()) <= 1e-6 * float(y32.abs().max())


def test_k_quant_sub_scales_are_checked():
    codes = torch.zeros(4, 512, dtype=torch.int8)
    x = torch.randn(1, 512)
    bad = torch.zeros(4, 16 + 3, dtype=torch.uint8)   # 16 groups and 1.5 super-block scales a row
    with pytest.raises(RuntimeError, match="super-blocks"):
        torch.ops.llmopt_cpu.w8_gemm(x, codes, bad, torch.empty(0), 32)
