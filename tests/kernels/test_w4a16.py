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
