"""Fused q/k/v and gate/up (llmopt/layers/fuse.py): the fused module's outputs equal the separate
modules' for every CPU-runtime format, M in {1, 4, 16, 64}, group sizes 32/64/128; the modules'
tensors become views of the fused storage (no second copy); a replaced, reloaded or hooked
projection falls back to separate calls; the engine's greedy tokens do not change."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from llmopt.quant.formats import pack_linear
from llmopt.layers.fuse import call_fused, drop_stale, fuse, fuse_quantized
from llmopt.layers.modules_w8a8 import W8Linear
from tests.quant.test_cpu_kernels import CASES, IN, MS, close, int_module, kernel_for_every_m, load, random_int  # noqa: F401

SIZES = (96, 32, 32)      # q, k, v rows (k/v narrower, as with GQA)


def _int_modules(fmt, bits, sym, act_order, gs, sizes=SIZES, seed=0):
    """Modules loaded from checkpoint tensors; act-order ones share one g_idx (one Hessian)."""
    mods, qts = [], []
    for i, out in enumerate(sizes):
        qt = random_int(bits, gs, sym, act_order, seed=seed + i)
        qt.qweight, qt.scales, qt.zeros = qt.qweight[:out], qt.scales[:out], qt.zeros[:out]
        if act_order and qts:
            qt.g_idx = qts[0].g_idx
        mods.append(load(int_module(fmt, qt, out), pack_linear("m", qt, fmt)))
        qts.append(qt)
    return mods, qts


class Owner(nn.Module):
    def __init__(self, mods):
        super().__init__()
        self.q, self.k, self.v = mods
        self._f = None


def _storages(mods) -> dict:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for m in mods for t in list(m.buffers()) + list(m.parameters()) if t.numel()}


def _check_fused(mods, wants, xs_ref):
    owner = Owner(mods)
    before = sum(_storages(mods).values())
    owner._f = fuse(owner, ("q", "k", "v"))
    assert owner._f is not None and not isinstance(owner._f.run, tuple)
    assert sum(_storages(mods).values()) <= before     # the modules' rows are views of the fused storage
    fused = {t.untyped_storage().data_ptr() for t in list(owner._f.run.buffers()) + list(owner._f.run.parameters())}
    rows = [t for mod in mods for t in list(mod.buffers()) + list(mod.parameters()) if t.shape[:1] == (mod.out_features,)]
    assert len(rows) >= 2 * len(mods) and {t.untyped_storage().data_ptr() for t in rows} <= fused
    for m in MS:
        x = xs_ref[m]
        got = call_fused(owner, "_f", x)
        assert len(got) == 3
        for g, mod, (ref, w) in zip(got, mods, wants[m]):
            close(g, ref, x, w)
            close(mod(x), ref, x, w)                    # the separate modules, now over views, agree
    return owner


@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("fmt,bits,sym,act_order", CASES)
def test_fused_packed_int_equals_separate(fmt, bits, sym, act_order, gs):
    mods, qts = _int_modules(fmt, bits, sym, act_order, gs)
    xs = {m: torch.randn(m, IN, generator=torch.Generator().manual_seed(m)) for m in MS}
    wants = {}
    for m, x in xs.items():
        wants[m] = []
        for mod, qt in zip(mods, qts):
            w = qt.dequantize(torch.float64)
            y = mod(x)                                   # the unfused module's own output
            close(y, x.double() @ w.t(), x, w)
            wants[m].append((y.double(), w))
    _check_fused(mods, wants, xs)


@pytest.mark.parametrize("kind,acts", [("int8", "none"), ("int8", "dynamic"), ("fp8", "none"), ("fp8", "dynamic")])
@pytest.mark.parametrize("per_channel", [True, False])
def test_fused_w8_equals_separate(kind, acts, per_channel):
    mods = []
    g = torch.Generator().manual_seed(3)
    for out in SIZES:
        w = torch.randn(out, IN, generator=g)
        amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
        s = amax / (127 if kind == "int8" else 448)
        codes = torch.round(w / s).clamp(-127, 127).to(torch.int8) if kind == "int8" else (w / s).to(torch.float8_e4m3fn)
        mods.append(load(W8Linear(IN, out, True, kind=kind, per_channel=per_channel, activations=acts),
                         {"m.weight": codes, "m.weight_scale": s.float()}))
        mods[-1].bias = nn.Parameter(torch.randn(out, generator=g), requires_grad=False)
    xs = {m: torch.randn(m, IN, generator=torch.Generator().manual_seed(m)) for m in MS}
    wants = {m: [(mod(x).double(), mod.weight.double() * mod.weight_scale.double().reshape(-1, 1))
                 for mod in mods] for m, x in xs.items()}
    _check_fused(mods, wants, xs)


@pytest.mark.parametrize("table_name,block", [("e2m1", 16), ("e2m1", 32), ("nf4", 64), ("bnb_fp4", 64)])
def test_fused_fp4_equals_separate(table_name, block):
    """NVFP4 (E2M1, block 16), MXFP4 (32) and bitsandbytes NF4 / FP4 (64) weights as the loaded
    Fp4Linear holds them (nibbles, float32 block scales): the fused call equals each module's
    product with its weight decoded from the 16-value table in float64."""
    from llmopt.kernels import cpu_quant
    from llmopt.layers.formats.fp4 import table
    from llmopt.layers.modules_fp4 import Fp4Linear
    g = torch.Generator().manual_seed(block)
    values = table(table_name).double()
    mods, weights = [], []
    for out in SIZES:
        codes = torch.randint(0, 16, (out, IN), generator=g, dtype=torch.uint8)
        scales = torch.rand(out, IN // block, generator=g) + 0.05
        mod = Fp4Linear(IN, out, True, table_name, block)
        mod.nibbles = True
        mod.register_buffer("codes", cpu_quant.pack_int4(codes), persistent=False)
        mod.register_buffer("scales", scales, persistent=False)
        mod.bias = nn.Parameter(torch.randn(out, generator=g), requires_grad=False)
        mods.append(mod)
        weights.append(values[codes.long()] * scales.double().repeat_interleave(block, 1))
    xs = {m: torch.randn(m, IN, generator=torch.Generator().manual_seed(m)) for m in MS}
    wants = {m: [(x.double() @ w.t() + mod.bias.double(), w) for mod, w in zip(mods, weights)] for m, x in xs.items()}
    _check_fused(mods, wants, xs)
    w4a4 = Fp4Linear(IN, 32, False, "e2m1", 16)
    w4a4.act_kind = "nvfp4"
    assert fuse_quantized([mods[1], mods[2]]) is not None and fuse_quantized([mods[1], w4a4]) is None


def test_layouts_that_differ_stay_unfused():
    """Act-order permutations that differ (one g_idx per projection), mixed bits or formats: None."""
    a, _ = _int_modules("gptq", 4, True, True, 64, sizes=(96,), seed=0)
    b, _ = _int_modules("gptq", 4, True, True, 64, sizes=(32,), seed=5)
    assert not torch.equal(a[0].cpu_perm, b[0].cpu_perm)
    assert fuse_quantized([a[0], b[0]]) is None
    c, _ = _int_modules("gptq", 8, True, False, 64, sizes=(32,))
    d, _ = _int_modules("gptq", 4, True, False, 64, sizes=(32,))
    assert fuse_quantized([c[0], d[0]]) is None
    w8 = load(W8Linear(IN, 32, False, kind="int8", per_channel=True, activations="none"),
              {"m.weight": torch.ones(32, IN, dtype=torch.int8), "m.weight_scale": torch.ones(32, 1)})
    assert fuse_quantized([d[0], w8]) is None


def test_replaced_or_hooked_projection_falls_back():
    mods, qts = _int_modules("awq", 4, False, False, 64)
    owner = Owner(mods)
    owner._f = fuse(owner, ("q", "k", "v"))
    x = torch.randn(3, IN)
    want = [m(x) for m in mods]
    seen = []
    h = owner.k.register_forward_hook(lambda *a: seen.append(1))
    assert all(torch.equal(g, w) for g, w in zip(call_fused(owner, "_f", x), want)) and seen == [1]
    h.remove()
    assert owner._f is not None                      # a hook only bypasses the fused call
    new, _ = _int_modules("awq", 4, False, False, 64, sizes=(32,), seed=9)
    owner.k = new[0]                                 # a replaced projection: separate calls for good
    got = call_fused(owner, "_f", x)
    assert owner._f is None and torch.equal(got[1], new[0](x)) and torch.equal(got[0], want[0])
    owner._f = fuse(owner, ("q", "k", "v"))
    owner.v._buffers["cpu_codes"] = owner.v.cpu_codes.clone()      # reloaded into new storage
    assert drop_stale(owner) == 1 and owner._f is None
    floats = Owner([nn.Linear(IN, n) for n in SIZES])
    floats._f = fuse(floats, ("q", "k", "v"))
    assert isinstance(floats._f.run, tuple)
    floats.q.weight.data = floats.q.weight.detach() * 2              # same Parameter, new memory
    with torch.no_grad():
        got = call_fused(floats, "_f", x)
        assert floats._f is None and torch.equal(got[0], floats.q(x))


def test_engine_greedy_tokens_unchanged_by_fusion(tiny_llama, tmp_path):
    """--quantization int8 and an AWQ w4 g32 checkpoint: the same greedy tokens with and without fusion."""
    from engine_helpers import mixed_prompts, run_engine
    from llmopt.engine.args import EngineArgs
    from llmopt.engine.engine import LLMEngine
    from llmopt.core.sampling_params import SamplingParams
    from llmopt.models.loader import load_model
    from llmopt.quant.formats import quantization_config
    from tests.quant_util import rtn, write_quantized
    awq = tmp_path / "awq"
    write_quantized(tiny_llama, awq, "awq", lambda w: rtn(w, 4, 32, False),
                    quantization_config("awq", method="awq", group_size=32))
    prompts = mixed_prompts(3, 96, lo=3, hi=40, seed=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for path, quant in ((tiny_llama, "int8"), (awq, None)):
        runs = []
        for fused in (True, False):
            lm = load_model(str(path), "float32", "cpu", tokenizer=False, quantization=quant)
            layers = lm.model.model.layers
            assert all(lyr.self_attn._qkv is not None and lyr.mlp._gate_up is not None for lyr in layers)
            if not fused:
                for lyr in layers:
                    lyr.self_attn._qkv = lyr.mlp._gate_up = None
            args = EngineArgs(model=str(path), dtype="float32", device="cpu", detokenize=False,
                              kv_cache_memory=1 << 22)
            runs.append(run_engine(LLMEngine(args, loaded=lm), prompts, params))
        assert runs[0] == runs[1]
