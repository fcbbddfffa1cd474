"""W8A8 activation quantization: one definition (llmopt.layers.activations) that the runtime
modules run and calibration simulates. Checked against vLLM's rules written out by hand, and the
calibration fake-quant against the runtime module's forward, including all-zero and tiny rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmopt.layers import fp8, int8
from llmopt.layers.activations import fake_quantize_tokens, quantize_tokens
from llmopt.quant.layerwise import LINEARS, quantize_layer
from llmopt.layers.modules_w8a8 import W8Linear
from llmopt.quant.config import QuantConfig
from quant_util import our_layer


def rows(k: int = 64, seed: int = 0) -> torch.Tensor:
    """Token rows: ordinary, an all-zero row, tiny magnitudes (below fp8's scale floor), one huge."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, k, generator=g)
    x[1] = 0.0
    x[2] *= 1e-6
    x[3] = torch.zeros(k).index_fill_(0, torch.tensor([5]), 3e-4)   # one tiny nonzero value
    x[4] *= 1e-30
    x[5] *= 1e4
    return x


def test_int8_rule_by_hand():
    x = torch.tensor([[254.0, -127.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [1e-30, -2e-30, 0.0, 3e-30]])
    codes, s = quantize_tokens(x, "int8")
    assert codes.dtype == torch.int8 and s.dtype == torch.float32
    assert s[:, 0].tolist() == [2.0, 1.0, pytest.approx(3e-30 / 127)]   # amax / 127; an all-zero row: 1
    assert codes[0].tolist() == [127, -64, 0, 0]     # -63.5 rounds half to even; 0.25 -> 0
    assert codes[1].tolist() == [0, 0, 0, 0]
    assert codes[2].tolist() == [42, -85, 0, 127]    # 1/3*127 = 42.33, 2/3*127 = 84.67
    torch.testing.assert_close(fake_quantize_tokens(x, "int8"), codes.float() * s, rtol=0, atol=0)


def test_fp8_rule_by_hand():
    floor = 1.0 / (448 * 512)
    x = torch.tensor([[896.0, -1.0, 0.0], [0.0, 0.0, 0.0], [1e-3, -5e-4, 0.0]])
    codes, s = quantize_tokens(x, "fp8")
    assert codes.dtype == torch.float8_e4m3fn
    assert s[:, 0].tolist() == [2.0, pytest.approx(floor), pytest.approx(floor)]   # amax/448, floored
    assert codes[0].float().tolist() == [448.0, -0.5, 0.0]
    assert codes[1].float().tolist() == [0.0, 0.0, 0.0]
    # 1e-3 * 448 * 512 = 229.4 -> e4m3 steps of 16 in [128, 256): 224; 114.7 -> steps of 8 in [64, 128): 112
    assert codes[2].float().tolist() == [224.0, -112.0, 0.0]
    assert fake_quantize_tokens(x, "fp8")[2, 0].item() == pytest.approx(224 * floor, rel=1e-6)


def w8_module(kind: str, w: torch.Tensor) -> tuple[W8Linear, torch.Tensor]:
    """A runtime W8A8 module holding w quantized per channel, and its dequantized weight."""
    qt = fp8.quantize_fp8(w) if kind == "fp8" else int8.quantize_int8(w)
    m = W8Linear(w.shape[1], w.shape[0], bias=False, kind=kind, per_channel=True, activations="dynamic")
    m.weight, m.weight_scale = qt.weight, qt.weight_scale.float()
    m.finish_loading()
    return m, qt.dequantize(torch.float32)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_fake_quant_then_matmul_is_the_runtime_forward(kind):
    torch.manual_seed(1)
    w = torch.randn(48, 64) * 0.2
    m, w_deq = w8_module(kind, w)
    x = rows()
    with torch.no_grad():
        runtime = m(x)
        simulated = F.linear(fake_quantize_tokens(x, kind), w_deq)
        weight_only = F.linear(x, w_deq)
    assert (runtime[0] - weight_only[0]).abs().max() > 1e-3      # activation rounding is visible
    assert runtime[1].abs().max() == 0 and simulated[1].abs().max() == 0
    for i in range(x.shape[0]):    # per row, relative to the row's size: float32 rounding only
        scale = simulated[i].abs().max().clamp(min=1e-38)
        assert ((runtime[i] - simulated[i]).abs().max() / scale) < 1e-5, (i, runtime[i], simulated[i])


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_calibration_error_report_runs_the_runtime_arithmetic(kind):
    """quantize_layer's error (W8A8 simulated) equals the error of the same layer with its Linears
    swapped for the runtime modules holding the quantized weights (int8: after SmoothQuant)."""
    layer, ctx = our_layer()
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(3))
    x[:, :, :3] *= 30.0                # outlier channels: what SmoothQuant moves into the weights
    with torch.no_grad():
        y_ref = ctx.forward(layer, x)  # the float layer, before quantize_layer changes it
    qconfig = QuantConfig(method=kind, activations="dynamic").resolved()
    res = quantize_layer(layer, x, 2, ctx, qconfig)
    for n in LINEARS:
        parent, child = n.rsplit(".", 1)
        qt = res.quantized[n]
        m = W8Linear(qt.weight.shape[1], qt.weight.shape[0], bias=False, kind=kind, per_channel=True,
                     activations="dynamic")
        m.weight, m.weight_scale = qt.weight, qt.weight_scale.float()
        setattr(layer.get_submodule(parent), child, m)
    with torch.no_grad():
        runtime = ctx.forward(layer, x)
    err = float((runtime - y_ref).double().pow(2).sum() / (y_ref - x).double().pow(2).sum())
    assert res.rel_error > 1e-6
    assert res.rel_error == pytest.approx(err, rel=1e-4)
    if kind == "fp8":      # FP8 passes on the quantized layer's output: the runtime's
        torch.testing.assert_close(res.next_x, runtime, rtol=1e-4, atol=1e-5)
