"""The CPU quantized modules (layers/modules*.py over kernels/cpu_quant): each format's module,
loaded from its checkpoint tensors, keeps packed codes (no float weight) and its forward equals
x @ dequantized(W)^T (float64 reference) within float32 rounding, for M in {1, 4, 16, 64}, group
sizes 32/64/128, with and without act-order g_idx; the int8 LM head and tied embedding; the
PyTorch fallback; and resident memory of a loaded W4 checkpoint (in a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from llmopt import defaults
from llmopt.kernels import cpu_quant
from llmopt.layers.activations import quantize_tokens
from llmopt.quant.formats import pack_linear
from llmopt.layers.modules import AWQLinear, CTPackedLinear, GPTQLinear
from llmopt.layers.modules_w8a8 import Int8Embedding, Int8Head, W8Linear, int8_rows
from llmopt.layers.types import IntQuantized

OUT, IN = 96, 384            # IN a multiple of 64 and 128
MS = (1, 4, 16, 64)


@pytest.fixture(autouse=True)
def kernel_for_every_m(monkeypatch):
    """The compiled kernel for every M here (the BLAS path past the threshold has its own test)."""
    monkeypatch.setattr(defaults, "CPU_QUANT_KERNEL_MAX_ROWS", 1 << 20)


def random_int(bits, gs, sym, act_order, seed=0, n_in=IN):
    g = torch.Generator().manual_seed(seed)
    groups = 1 if gs == -1 else n_in // gs
    q = torch.randint(0, 1 << bits, (OUT, n_in), generator=g, dtype=torch.int32)
    if sym:
        z = torch.full((OUT, groups), 1 << (bits - 1), dtype=torch.int32)
    else:
        z = torch.randint(1, 1 << bits, (OUT, groups), generator=g, dtype=torch.int32)
    s = (torch.rand(OUT, groups, generator=g) * 0.1 + 0.01).half().float()
    g_idx = None
    if act_order:
        order = torch.randperm(n_in, generator=g)
        g_idx = torch.empty(n_in, dtype=torch.int32)
        g_idx[order] = (torch.arange(n_in) // gs).to(torch.int32)
    return IntQuantized(qweight=q, scales=s, zeros=z, bits=bits, group_size=gs, sym=sym, g_idx=g_idx)


def load(module, tensors: dict[str, torch.Tensor]):
    for name, t in tensors.items():
        module._buffers[name.rpartition(".")[2]] = t
    module.finish_loading()
    return module


def x_of(m, n_in=IN, seed=1):
    return torch.randn(m, n_in, generator=torch.Generator().manual_seed(seed))


def close(y, ref, x, w):
    """Within float32 rounding: error below 1e-5 of sum |x||w| per output (a wrong code is far off)."""
    bound = 1e-5 * (x.double().abs() @ w.double().abs().t()) + 1e-6
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {err.max():.3g}, bound {bound.min():.3g}"


def no_float_weight(module):
    for name, b in list(module.named_buffers()) + list(module.named_parameters()):
        assert not (b.is_floating_point() and b.numel() >= OUT * IN // 8 and b.dtype != torch.float8_e4m3fn), \
            f"{name} is a float tensor of {tuple(b.shape)}"


def int_module(fmt, qt, out=OUT):
    dims = (IN, out, False)
    if fmt == "awq":
        return AWQLinear(*dims, bits=qt.bits, group_size=qt.group_size)
    if fmt == "gptq":
        return GPTQLinear(*dims, bits=qt.bits, group_size=qt.group_size, sym=qt.sym)
    return CTPackedLinear(*dims, bits=qt.bits, group_size=qt.group_size, sym=qt.sym)


CASES = [(fmt, bits, sym, act) for fmt, bits, sym, act in [
    ("awq", 4, False, False), ("gptq", 4, True, False), ("gptq", 4, True, True), ("gptq", 4, False, True),
    ("gptq", 8, True, False), ("gptq", 8, True, True), ("compressed-tensors", 4, True, False),
    ("compressed-tensors", 4, False, False), ("compressed-tensors", 8, True, False)]]


@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("fmt,bits,sym,act_order", CASES)
def test_packed_int_modules_match_dequantized(fmt, bits, sym, act_order, gs):
    qt = random_int(bits, gs, sym, act_order)
    mod = load(int_module(fmt, qt), pack_linear("m", qt, fmt))
    assert mod._cpu is not None and mod._cpu[0] == ("w4" if bits == 4 else "w8")
    assert (mod.cpu_perm is not None) == act_order
    no_float_weight(mod)
    w = qt.dequantize(torch.float64)
    assert torch.allclose(mod.dequantized(torch.float64), w, rtol=1e-6, atol=1e-7)
    for m in MS:
        x = x_of(m)
        close(mod(x), x.double() @ w.t(), x, w)


def test_per_channel_and_bias():
    qt = random_int(4, -1, True, False)
    qt.bias = torch.randn(OUT)
    mod = load(CTPackedLinear(IN, OUT, True, bits=4, group_size=-1, sym=True), pack_linear("m", qt, "compressed-tensors"))
    mod.bias = torch.nn.Parameter(qt.bias, requires_grad=False)
    w = qt.dequantize(torch.float64)
    x = x_of(5)
    close(mod(x.view(1, 5, IN)).view(5, OUT), x.double() @ w.t() + qt.bias.double(), x, w)


@pytest.mark.parametrize("kind,acts", [("int8", "dynamic"), ("fp8", "dynamic"), ("fp8", "none"), ("int8", "none")])
@pytest.mark.parametrize("per_channel", [True, False])
def test_w8_modules_match_emulation(kind, acts, per_channel):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(OUT, IN, generator=g)
    amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    if kind == "int8":
        s = amax / 127
        codes = torch.round(w / s).clamp(-127, 127).to(torch.int8)
    else:
        s = amax / 448
        codes = (w / s).to(torch.float8_e4m3fn)
    mod = W8Linear(IN, OUT, False, kind=kind, per_channel=per_channel, activations=acts)
    load(mod, {"m.weight": codes, "m.weight_scale": s.float()})
    no_float_weight(mod)
    wd = codes.double() * s.double()
    for m in MS:
        x = x_of(m)
        if acts == "dynamic":
            xq, sx = quantize_tokens(x, kind)
            ref = (xq.double() @ codes.double().t()) * sx.double() * s.double().reshape(1, -1)
            close(mod(x), ref, xq.float() * sx, wd)
        else:
            close(mod(x), x.double() @ wd.t(), x, wd)


def test_blas_path_past_the_threshold(monkeypatch):
    """Past CPU_QUANT_KERNEL_MAX_ROWS the weight is dequantized a slice of rows at a time."""
    monkeypatch.setattr(defaults, "CPU_QUANT_KERNEL_MAX_ROWS", 2)
    monkeypatch.setattr(cpu_quant, "ROWS_PER_SLICE", 40)     # several slices, a ragged last one
    qt = random_int(4, 64, False, True)
    mod = load(int_module("gptq", qt), pack_linear("m", qt, "gptq"))
    w = qt.dequantize(torch.float64)
    x = x_of(16)
    close(mod(x), x.double() @ w.t(), x, w)


def test_int4_layout():
    codes = torch.arange(128).remainder(16).view(1, 128).repeat(2, 1)
    packed = cpu_quant.pack_int4(codes)
    assert packed.shape == (2, 64) and packed.dtype == torch.uint8
    for j in range(32):   # byte 32b + j: column 64b + j low, 64b + 32 + j high
        for b in range(2):
            assert int(packed[0, 32 * b + j]) == int(codes[0, 64 * b + j]) | (int(codes[0, 64 * b + 32 + j]) << 4)
    assert torch.equal(cpu_quant.unpack_int4(packed), codes.to(torch.uint8))


def test_int8_head_and_tied_embedding():
    g = torch.Generator().manual_seed(5)
    table = torch.randn(300, IN, generator=g)
    codes, scales = int8_rows(table, rows_per_slice=64)
    assert codes.dtype == torch.int8 and scales.shape == (300,)
    head = Int8Head(codes, scales)
    emb = Int8Embedding(head, torch.float32)
    wd = codes.double() * scales.double()[:, None]
    assert (wd - table.double()).abs().max() <= scales.max() / 2 + 1e-6     # round to nearest
    ids = torch.tensor([[0, 299, 7], [5, 5, 1]])
    assert torch.allclose(emb(ids).double(), wd[ids], rtol=1e-6, atol=0)
    for m in MS:
        x = x_of(m)
        close(head(x), x.double() @ wd.t(), x, wd)


def test_fallback_without_the_compiled_ops(monkeypatch):
    monkeypatch.setattr(cpu_quant, "ops", lambda: None)
    qt = random_int(4, 32, False, False)
    mod = load(int_module("awq", qt), pack_linear("m", qt, "awq"))
    w = qt.dequantize(torch.float64)
    x = x_of(3)
    close(mod(x), x.double() @ w.t(), x, w)
    wf = torch.randn(OUT, IN).to(torch.float8_e4m3fn)
    sf = torch.rand(OUT) + 0.5
    ref = x.double() @ (wf.double() * sf.double()[:, None]).t()
    close(cpu_quant.f8_gemm(x, wf.view(torch.uint8), sf), ref, x, wf.double() * sf.double()[:, None])


def test_unequal_act_order_groups_dequantize_per_call():
    qt = random_int(4, 64, True, False)
    qt.g_idx = torch.zeros(IN, dtype=torch.int32)
    qt.g_idx[IN // 2:] = torch.arange(IN // 2, dtype=torch.int32) % (IN // 64)   # group 0 is larger
    mod = load(int_module("gptq", qt), pack_linear("m", qt, "gptq"))
    assert mod._cpu is None
    w = qt.dequantize(torch.float64)
    x = x_of(2)
    close(mod(x), x.double() @ w.t(), x, w)


MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from llmopt.kernels import cpu_quant
    from llmopt.models.loader import load_model
    from llmopt.layers.runtime import release_freed_memory
    def rss_anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    # a first load pays the lazy imports and first-use caches (the kernels' build too); the
    # model's own memory is what a second load adds once the first is gone
    lm = load_model(sys.argv[1], dtype="float32", device="cpu", tokenizer=False)
    del lm
    release_freed_memory()
    before = rss_anon()
    lm = load_model(sys.argv[1], dtype="float32", device="cpu", tokenizer=False)
    after = rss_anon()
    print(json.dumps({"delta": after - before,
                      "float_bytes": sum(p.numel() for p in lm.model.parameters()) * 4}))
""")


def test_w4_checkpoint_stays_packed_in_memory(tmp_path):
    """RssAnon grows by less than a third of the model's float32 size when a W4 checkpoint of a
    model with large layers loads (int8 head included)."""
    from tests.conftest import make_tiny
    from tests.quant_util import rtn, write_quantized
    from llmopt.quant.formats import quantization_config
    src = make_tiny(tmp_path / "float", hidden_size=1024, intermediate_size=4096, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=8, head_dim=128, vocab_size=4096)
    dst = tmp_path / "awq"
    write_quantized(src, dst, "awq", lambda w: rtn(w, 4, 64, False), quantization_config("awq", method="awq",
                                                                                        group_size=64))
    cfg = json.loads((src / "config.json").read_text())
    linears = cfg["num_hidden_layers"] * (4 * 1024 * 1024 + 3 * 1024 * 4096)
    float_bytes = (linears + 2 * 4096 * 1024) * 4
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(dst)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["delta"] * 3 <= float_bytes, f"RssAnon grew {got['delta']:,} bytes for {float_bytes:,} of float32"
