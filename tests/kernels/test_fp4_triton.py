"""The Triton dequantize-GEMM of 4-bit float weights (llmopt.kernels.fp4_triton) on the CPU under
TRITON_INTERPRET=1: FP4 E2M1, NF4 and bitsandbytes' FP4 codes in the int4 nibble layout with a float32
scale per block of 16, 32 or 64, against a float64 product of weights built here from each format's
definition; and Fp4Linear's Triton path (what runs on CUDA) against the same product."""

import os

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported anywhere in this process

import pytest  # noqa: E402
import torch  # noqa: E402

from llmopt.kernels.cpu_quant import pack_int4  # noqa: E402
from llmopt.kernels.fp4_triton import fp4_matmul, fp4_reference  # noqa: E402
from llmopt.layers.formats.fp4 import Fp4Quantized, table  # noqa: E402
from llmopt.layers.modules_fp4 import Fp4Linear  # noqa: E402
from fp4_util import DEFINITIONS  # noqa: E402


def make(name, n, k, block, seed):
    """Random codes [n, k] and scales; the packed codes; the float64 weight from the format's definition."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // block, generator=g) * 2 + 0.05
    values = torch.tensor(DEFINITIONS[name], dtype=torch.float64)
    w = (values[codes.long()].view(n, -1, block) * scales.double()[..., None]).view(n, k)
    return codes, pack_int4(codes), scales, w


def close(y, want, dtype):
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-3, 2e-3)
    torch.testing.assert_close(y.double(), want, rtol=rtol, atol=atol * float(want.abs().max()))


@pytest.mark.parametrize("name", list(DEFINITIONS))
@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("M", [1, 3, 16, 64])
def test_fp4_matmul_equals_float64_of_the_definition(name, block, M):
    """N = 72: a full tile of 64 and a masked one; K = 192 (three 64-column blocks); float32 and float16 x."""
    n, k = 72, 192
    codes, packed, scales, w = make(name, n, k, block, seed=M * 100 + block)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(M, k, generator=torch.Generator().manual_seed(M)).to(dtype)
        want = x.double() @ w.t()
        y = fp4_matmul(x, packed, scales, block, table(name))
        assert y.shape == (M, n) and y.dtype == dtype
        close(y, want, dtype)
    torch.testing.assert_close(fp4_reference(x.float(), packed, scales, block, table(name)).double(), want,
                               rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("gemv,dtype", [(True, torch.bfloat16), (True, torch.float16), (False, torch.float16)])
def test_both_paths_and_a_128_column_tile(gemv, dtype):
    """K = 256: the GEMM (and the 1-2 row GEMV) take K-tiles of 128, two 64-column blocks a tile; each
    path forced at a row count the other would take by default; N = 5 (one masked tile). (bf16 through
    the GEMM's tl.dot is left to scripts/gpu_check.py: triton 3's interpreter multiplies bf16's raw
    uint16 bits there.)"""
    n, k, block = 5, 256, 16
    codes, packed, scales, w = make("e2m1", n, k, block, seed=9)
    for M in (2, 7):
        x = torch.randn(M, k, generator=torch.Generator().manual_seed(M)).to(dtype)
        y = fp4_matmul(x, packed, scales, block, table("e2m1"), gemv=gemv)
        assert y.dtype == dtype
        want = x.double() @ w.t()
        torch.testing.assert_close(y.double(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


def test_one_column_at_a_time_finds_its_nibble():
    """A single nonzero code at each column of two 64-column blocks: y[0, n] picks exactly x[0, k] times
    the table value times its own block's scale (a mixed-up nibble, byte or scale shows at once)."""
    k, block = 128, 16
    n = k
    codes = torch.zeros(n, k, dtype=torch.uint8)
    codes[torch.arange(n), torch.arange(n)] = 5            # row r holds code 5 at column r, code 0 (zero) elsewhere
    scales = torch.arange(1, n * (k // block) + 1, dtype=torch.float32).view(n, k // block)
    x = torch.arange(1, k + 1, dtype=torch.float32)[None] / k
    y = fp4_matmul(x, pack_int4(codes), scales, block, table("e2m1"))
    cols = torch.arange(n)
    want = x[0, cols].double() * 3.0 * scales[cols, cols // block].double()   # E2M1 code 5 is 3.0
    torch.testing.assert_close(y[0].double(), want, rtol=1e-6, atol=0)


def test_bad_arguments_are_one_line_errors():
    codes, packed, scales, _ = make("nf4", 8, 128, 32, seed=1)
    x, t = torch.randn(2, 128), table("nf4")
    bad = [
        (x[0], packed, scales, 32, t),                          # 1-D x
        (x.double(), packed, scales, 32, t),                    # float64 x
        (torch.randn(2, 96), packed, scales, 32, t),            # K not a multiple of 64
        (torch.randn(2, 192), packed, scales, 32, t),           # codes of another width
        (x, codes, scales, 32, t),                              # one code a byte
        (x, packed, scales, 64, t),                             # scales of another block
        (x, packed, scales, 48, t),                             # no such block
        (x, packed, scales.half(), 32, t),                      # fp16 scales
        (x, packed, scales, 32, t[:8]),                         # 8 table values
    ]
    for args in bad:
        with pytest.raises(ValueError, match="fp4_matmul: ") as e:
            fp4_matmul(*args)
        assert "\n" not in str(e.value)


class _Loaded(Fp4Linear):
    """An Fp4Linear whose checkpoint form is given (as a subclass's canonical() would build it)."""

    def __init__(self, q: Fp4Quantized, bias: torch.Tensor | None) -> None:
        super().__init__(q.in_features, q.out_features, bias is not None, q.table_name, q.block)
        self._q = q
        if bias is not None:
            self.bias = torch.nn.Parameter(bias, requires_grad=False)

    def canonical(self) -> Fp4Quantized:
        return self._q


@pytest.mark.parametrize("name,block", [("e2m1", 16), ("nf4", 64), ("bnb_fp4", 32)])
def test_fp4_linear_triton_path(name, block):
    """What Fp4Linear.forward runs for CUDA x (here on CPU tensors, interpreted): its runtime form
    (nibbles, float32 scales) through the kernel, the bias added, x's leading dims and dtype kept; it
    equals the float64 product and the module's CPU forward."""
    n, k = 40, 128
    codes, _, scales, w = make(name, n, k, block, seed=block)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    lin = _Loaded(Fp4Quantized(codes, scales, name, block), bias)
    lin.finish_loading()
    assert lin.nibbles and set(lin._buffers) == {"codes", "scales"}
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(4))
    want = x.double() @ w.t() + bias.double()
    y = lin._triton_forward(x)
    assert y.shape == (2, 3, n) and y.dtype == torch.float32
    close(y, want, torch.float32)
    close(lin(x), want, torch.float32)                      # the CPU path (C++ kernels or dequantized slices)
    y16 = lin._triton_forward(x.half())
    assert y16.dtype == torch.float16
    close(y16, want, torch.float16)


def test_fp4_linear_without_nibbles_stays_on_the_dequantized_path():
    """in_features not a multiple of 64: codes a byte a code, which the kernel does not read."""
    codes = torch.randint(0, 16, (8, 96), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    scales = torch.rand(8, 3) + 0.05
    lin = _Loaded(Fp4Quantized(codes, scales, "e2m1", 32), None)
    lin.finish_loading()
    assert not lin.nibbles and lin._triton_forward(torch.randn(1, 96)) is None
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(5))
    w = torch.tensor(DEFINITIONS["e2m1"], dtype=torch.float64)[codes.long()] * scales.double().repeat_interleave(32, 1)
    close(lin(x), x.double() @ w.t(), torch.float32)
