"""The C++ kernels' 4-bit float weights (cpu_quant_tiles.h N4 in the tiles and float panels, through
torch.ops.llmopt_cpu.fp4_gemm): FP4 E2M1, NF4 and bitsandbytes' FP4 codes in the int4 nibble layout
with a float32 scale per block, decoded inside the loop, against a float64 product of weights built
here from each format's definition, for M = 1, 3, 16 and 64 rows of x."""

from __future__ import annotations

import pytest
import torch

from llmopt.kernels import cpu_quant
from llmopt.layers.formats.fp4 import TABLES
from fp4_util import DEFINITIONS

pytestmark = pytest.mark.skipif(cpu_quant.ops() is None, reason="needs the C++ kernels (g++, AVX2)")


@pytest.fixture(scope="module")
def ops():
    return cpu_quant.ops()


def test_the_tables_are_the_formats_definitions():
    for name, values in DEFINITIONS.items():
        assert torch.equal(torch.tensor(TABLES[name], dtype=torch.float32), torch.tensor(values, dtype=torch.float32))


@pytest.mark.parametrize("name", list(DEFINITIONS))
@pytest.mark.parametrize("n,k,block", [(5, 64, 16), (37, 192, 32), (64, 576, 64), (24, 1536, 16)])
def test_fp4_gemm_equals_float64_of_the_definition(ops, name, n, k, block):
    g = torch.Generator().manual_seed(n * k + block)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // block, generator=g) * 2 + 0.05
    values = torch.tensor(DEFINITIONS[name], dtype=torch.float64)
    w = (values[codes.long()].view(n, -1, block) * scales.double()[..., None]).view(n, k)
    packed = cpu_quant.pack_int4(codes)
    full = None
    for m in (1, 3, 16, 64):
        x = torch.randn(64, k, generator=g)[:m].contiguous()
        y = ops.fp4_gemm(x, packed, scales, block, cpu_quant.FP4_KINDS[name])
        ref = x.double() @ w.t()
        bound = 1e-6 * (x.double().abs() @ w.abs().t()) + 1e-7
        assert bool(((y.double() - ref).abs() <= bound).all()), (m, float((y.double() - ref).abs().max()))
        if m == 16:
            full = (x, y)
    x, y = full   # each row's bits whatever the row count (the tiles), and for a slice of the weight's rows
    assert torch.equal(ops.fp4_gemm(x[5:9].contiguous(), packed, scales, block, cpu_quant.FP4_KINDS[name]), y[5:9])
    assert torch.equal(ops.fp4_gemm(x, packed[2:].contiguous(), scales[2:].contiguous(), block,
                                    cpu_quant.FP4_KINDS[name]), y[:, 2:])


def test_fp4_gemm_refuses_what_it_cannot_run(ops):
    x = torch.randn(2, 64)
    codes, scales = torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 4)
    with pytest.raises(RuntimeError, match="kind must be 8"):
        ops.fp4_gemm(x, codes, scales, 16, 2)
    with pytest.raises(RuntimeError, match="K % 64"):
        ops.fp4_gemm(torch.randn(2, 32), torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 2), 16, 8)
    with pytest.raises(RuntimeError, match="scales must be"):
        ops.fp4_gemm(x, codes, torch.ones(4, 3), 16, 8)
    with pytest.raises(RuntimeError, match="float32"):
        ops.fp4_gemm(x, codes, scales.half(), 16, 8)
