"""The Triton W4A16 dequantize-GEMM against PyTorch, on the CPU under TRITON_INTERPRET=1."""

import os

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported anywhere in this process

import pytest  # noqa: E402
import torch  # noqa: E402

from llmopt.kernels.w4a16 import w4a16_matmul, w4a16_reference  # noqa: E402
from llmopt.layers.formats.packing import pack_codes  # noqa: E402


def make(K, N, group_size, bits=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (K, N), generator=g, dtype=torch.int32)
    groups = K // group_size
    scales = (torch.rand(groups, N, generator=g) * 0.05 + 0.01).half()
    zeros = torch.randint(0, 1 << bits, (groups, N), generator=g).half()
    return codes, pack_codes(codes, bits, dim=0), scales, zeros


def dense(codes, scales, zeros, group_size):
    """float64 dequantization written directly from the codes (not through the packed words)."""
    g = torch.arange(codes.shape[0]) // group_size
    return (codes.double() - zeros.double()[g]) * scales.double()[g]


@pytest.mark.parametrize("M,gemv", [(1, True), (3, True), (5, False), (20, False), (2, False)])
@pytest.mark.parametrize("group_size", [32, 64])
def test_matches_float64_and_the_reference(M, gemv, group_size):
    K, N = 128, 96
    codes, q, s, z = make(K, N, group_size, seed=M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1))
    want = x.double() @ dense(codes, s, z, group_size)
    y = w4a16_matmul(x, q, s, z, group_size, gemv=gemv)
    assert y.shape == (M, N) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(w4a16_reference(x, q, s, z, group_size).double(), want, rtol=1e-5, atol=1e-4)


def test_half_inputs_and_per_channel_groups():
    K, N = 64, 32
    codes, q, s, z = make(K, N, K, seed=7)          # group_size = K: one group (per channel)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(2)).half()
    want = x.double() @ dense(codes, s, z, K)
    for gemv in (True, False):
        y = w4a16_matmul(x, q, s, z, K, gemv=gemv)
        assert y.dtype == torch.float16
        torch.testing.assert_close(y.double(), want, rtol=2e-3, atol=2e-2)


@pytest.mark.parametrize("gemv", [True, False])
def test_groups_that_straddle_tiles(gemv):
    """group_size 48 is not a multiple of any tile: each row of a tile looks up its own group."""
    K, N = 96, 32
    codes, q, s, z = make(K, N, 48, seed=11)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(4))
    want = x.double() @ dense(codes, s, z, 48)
    torch.testing.assert_close(w4a16_matmul(x, q, s, z, 48, gemv=gemv).double(), want, rtol=1e-5, atol=1e-4)


def test_eight_bit_weights():
    K, N = 64, 48
    codes, q, s, z = make(K, N, 32, bits=8, seed=3)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(3))
    want = x.double() @ dense(codes, s, z, 32)
    torch.testing.assert_close(w4a16_matmul(x, q, s, z, 32, bits=8).double(), want, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors"])
def test_modules_repack_every_format_for_the_kernel(fmt):
    """What a quantized module runs on a GPU: its checkpoint tensors repacked into the kernel's
    layout (act-order columns sorted by group), against the module's CPU path."""
    from llmopt.quant.formats import pack_linear
    from llmopt.layers.modules import AWQLinear, CTPackedLinear, GPTQLinear
    from llmopt.layers.types import IntQuantized
    out, n_in, gs = 32, 128, 32
    g = torch.Generator().manual_seed(5)
    qt = IntQuantized(qweight=torch.randint(0, 16, (out, n_in), generator=g, dtype=torch.int32),
                      scales=(torch.rand(out, n_in // gs, generator=g) * 0.1).half().float(),
                      zeros=torch.randint(1, 16, (out, n_in // gs), generator=g, dtype=torch.int32),
                      bits=4, group_size=gs, sym=False)
    if fmt == "gptq":   # act-order: column perm[i] belongs to group i // gs
        perm = torch.randperm(n_in, generator=g)
        qt.g_idx = (torch.argsort(perm) // gs).to(torch.int32)
        mod = GPTQLinear(n_in, out, False, 4, gs, sym=False)
    elif fmt == "awq":
        mod = AWQLinear(n_in, out, False, 4, gs)
    else:
        mod = CTPackedLinear(n_in, out, False, 4, gs, sym=False)
    for name, t in pack_linear("m", qt, fmt).items():
        mod._buffers[name[2:]] = t
    x = torch.randn(3, n_in, generator=g)
    want = x @ qt.dequantize().t()                 # (the modules' CPU path: tests/quant/test_cpu_kernels.py)
    mod._check_loaded()
    mod._prepare_kernel()                          # what finish_loading does on a GPU
    qweight, scales, zeros, perm, group = mod._kernel
    xk = x if perm is None else x[:, perm]
    for gemv in (True, False):
        torch.testing.assert_close(w4a16_matmul(xk, qweight, scales, zeros, group, gemv=gemv), want,
                                   rtol=1e-4, atol=1e-4)


def _ggml(type_name, n, k, seed=0):
    """A tensor in GGML block type `type_name` (the gguf package's quantizer, or random K-quant
    blocks), its decoded codes and the gguf package's float64 dequantization [n, k]."""
    import gguf
    import numpy as np
    from gguf_util import ggml_bytes
    from llmopt.layers.formats.ggml import decode
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.2
    if type_name == "Q4_1":
        w[1, 32:64] = 0.37           # a constant block: d = 0, m = 0.37
    raw = ggml_bytes(w, type_name, seed)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return decode(type_name, raw, k), torch.from_numpy(np.asarray(ref, dtype=np.float64)).reshape(n, k)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("M", [1, 3, 16])
def test_gguf_blocks_repacked_for_the_kernel(type_name, M):
    """A GGUF tensor on CUDA: its blocks repacked once into the kernel's layout multiply equal to a
    float64 product of the gguf package's dequantization (within float32 rounding), the token
    table's rows decode from that layout alone, and it holds what kv-estimate counts for a GPU."""
    from llmopt.ggml_types import held_bytes
    from llmopt.layers.modules_ggml import GGMLEmbedding, GGMLLinear
    n, k = 48, 256 if type_name.endswith("_K") else 96
    g, ref = _ggml(type_name, n, k, seed=M)
    lin = GGMLLinear(g, type_name, triton=True)
    qweight, scales, zeros, perm, gs = lin._kernel
    assert perm is None and lin.bits == (4 if type_name in ("Q4_0", "Q4_1", "Q4_K") else 8)
    assert sum(t.nbytes for t in (qweight, scales, zeros)) == held_bytes(type_name, (n, k), device="cuda")
    assert qweight.dtype == torch.int32 and qweight.shape == (k * lin.bits // 32, n) and not lin._buffers
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(M))
    want = x.double() @ ref.t()
    got = w4a16_matmul(x, qweight, scales, zeros, gs, lin.bits)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    torch.testing.assert_close(lin.dequantized().double(), ref, rtol=0, atol=1e-6)
    ids = torch.tensor([[1, 0, 47], [5, 5, 2]])
    rows = GGMLEmbedding(lin, torch.float32, owner=False)(ids)
    torch.testing.assert_close(rows.double(), ref[ids], rtol=0, atol=1e-6)
