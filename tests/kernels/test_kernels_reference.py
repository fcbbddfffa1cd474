"""The PyTorch reference kernels against independent float64 computations."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmopt import kernels
from llmopt.errors import UserInputError
from llmopt.kernels import reference as ref
from paged_batch import dense_attention, make_batch, run_paged

# (context_len, query_len): decode, full prefill, extend (chunked prefill), on and off block ends
SPECS = [(1, 1), (16, 1), (37, 1), (16, 16), (23, 23), (40, 7), (33, 1), (48, 16), (5, 2)]


def _batch(*args, **kw):
    return make_batch(*args, garbage="big", **kw)  # the reference needs finite values past a sequence's end


def _dense_kv(b):
    """Per-sequence dense K/V as the cache should hold them (dequantized with an independent formula)."""
    k, v = b.k_new.double(), b.v_new.double()
    if b.kv_dtype == "int8":
        k, v = (_int8_roundtrip(x) for x in (k, v))
    elif b.kv_dtype == "int4":
        k, v = (_gguf_q4_0_roundtrip(x) for x in (b.k_new, b.v_new))
    elif b.kv_dtype != "auto":
        fp8 = ref.kv_cache_torch_dtype(b.kv_dtype, torch.float32)
        m = ref.FP8_MAX[fp8]
        k = (k / b.k_scale).clamp(-m, m).float().to(fp8).double() * b.k_scale
        v = (v / b.v_scale).clamp(-m, m).float().to(fp8).double() * b.v_scale
    lens = [c for c, _ in b.specs]
    return list(k.split(lens)), list(v.split(lens))


def _gguf_q4_0_roundtrip(x):
    """Rows through the gguf package's own Q4_0 quantizer and dequantizer (llama.cpp's reference)."""
    from gguf import GGMLQuantizationType, quants
    a = x.float().numpy().reshape(-1, x.shape[-1])
    back = quants.dequantize(quants.quantize(a, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
    return torch.from_numpy(back).reshape(x.shape).double()


def _int8_roundtrip(x):
    s = x.abs().amax(-1, keepdim=True) / 127
    return torch.round(x / s) * s


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_dense_float64(hq, hkv, block_size, window):
    b = _batch(SPECS, hq, hkv, 8, block_size, seed=hq * 100 + block_size)
    scale = 1 / math.sqrt(8)
    out = run_paged(ref.paged_attention, b, scale, window)
    ks, vs = _dense_kv(b)
    want = dense_attention(b.q, ks, vs, b.specs, scale, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)


def test_per_step_plan_follows_its_metadata():
    """The decode plan (buckets, index tensors, masks) is built once per metadata tensors and reused
    by every layer of a step: alternating windows keep their own plans, and metadata modified in
    place (or new tensors, in inference mode too) are planned afresh."""
    from dataclasses import replace
    b = _batch([(37, 1), (16, 1), (9, 1), (23, 4)], 6, 2, 8, 4, seed=11)

    def fresh(window):                         # new metadata tensors: never a cached plan
        return run_paged(ref.paged_attention, replace(b, block_tables=b.block_tables.clone(),
                         seq_lens=b.seq_lens.clone(), query_start_loc=b.query_start_loc.clone()), 0.3, window)
    for window in (None, 5, None, 5):          # the same tensors: one plan per window, reused
        assert torch.equal(run_paged(ref.paged_attention, b, 0.3, window), fresh(window))
    before = run_paged(ref.paged_attention, b, 0.3, None)
    b.seq_lens[0] -= 20                        # in place: sequence 0 attends its first 17 tokens now
    got = run_paged(ref.paged_attention, b, 0.3, None)
    assert torch.equal(got, fresh(None)) and not torch.equal(got[0], before[0])
    with torch.inference_mode():
        b = replace(b, seq_lens=b.seq_lens + 0)
        assert torch.equal(run_paged(ref.paged_attention, b, 0.3, None), got)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2", "int8", "int4"])
def test_quantized_cache_attention_matches_dense(kv_dtype):
    d = 32 if kv_dtype == "int4" else 8   # int4: blocks of 32 values along the head
    b = _batch(SPECS, 6, 2, d, 16, kv_dtype=kv_dtype, seed=7, k_scale=0.5, v_scale=0.25)
    out = run_paged(ref.paged_attention, b, 0.3, None)
    ks, vs = _dense_kv(b)
    torch.testing.assert_close(out.double(), dense_attention(b.q, ks, vs, b.specs, 0.3, None), atol=2e-6, rtol=2e-6)
    # and the quantization error stays small against the exact K/V
    exact = dense_attention(b.q, b.k_new.split([c for c, _ in SPECS]), b.v_new.split([c for c, _ in SPECS]),
                            b.specs, 0.3, None)
    assert (out.double() - exact).abs().max() < {"fp8": 0.2, "fp8_e5m2": 0.4, "int8": 0.05, "int4": 0.8}[kv_dtype]


def test_float64_and_bfloat16_inputs():
    b = _batch(SPECS, 4, 2, 8, 4, dtype=torch.float64, seed=3)
    out = run_paged(ref.paged_attention, b, 0.5, 6)
    ks, vs = _dense_kv(b)
    torch.testing.assert_close(out, dense_attention(b.q, ks, vs, b.specs, 0.5, 6), atol=1e-12, rtol=1e-12)
    b = _batch(SPECS, 4, 2, 8, 4, dtype=torch.bfloat16, seed=3)
    out = run_paged(ref.paged_attention, b, 0.5, None)
    assert out.dtype == torch.bfloat16
    ks, vs = _dense_kv(b)
    torch.testing.assert_close(out.double(), dense_attention(b.q, ks, vs, b.specs, 0.5, None), atol=2e-2, rtol=2e-2)


def _fp8_error_ok(x, stored, scale, fp8):
    """fp8 rounding: relative error <= 2^-(mantissa bits + 1) for normals, half a subnormal step below."""
    mant, min_normal = (3, 2.0 ** -6) if fp8 == torch.float8_e4m3fn else (2, 2.0 ** -14)
    y = x / scale
    m = ref.FP8_MAX[fp8]
    target = y.clamp(-m, m)
    got = stored.double()
    bound = torch.maximum(target.abs() * 2.0 ** -(mant + 1), torch.full_like(target, min_normal * 2.0 ** -(mant + 1)))
    return bool(((got - target).abs() <= bound + 1e-12).all())


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_write_kv_fp8_rounds_and_clamps(kv_dtype):
    fp8 = ref.kv_cache_torch_dtype(kv_dtype, torch.float32)
    kc, vc, _, _ = (torch.zeros(4, 2, 2, 8, dtype=fp8) for _ in range(4))
    k = torch.randn(5, 2, 8, dtype=torch.float64) * 3
    k[0, 0, 0] = 1e6  # beyond the range: clamped to the max, not inf/NaN
    v = torch.randn(5, 2, 8, dtype=torch.float64)
    slots = torch.tensor([7, 0, 3, -1, 4])
    ref.write_kv(kc, vc, k, v, slots, kv_dtype, 0.01, 2.0)
    keep = slots >= 0
    got_k = kc.view(8, 2, 8)[slots[keep]]
    assert _fp8_error_ok(k[keep].double(), got_k, 0.01, fp8)
    assert _fp8_error_ok(v[keep].double(), vc.view(8, 2, 8)[slots[keep]], 2.0, fp8)
    assert got_k[0, 0, 0].double() == ref.FP8_MAX[fp8]
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert (kc.view(8, -1)[untouched].double() == 0).all()  # the -1 slot wrote nothing


def test_write_kv_int8_per_token_head_scales():
    kc = torch.zeros(3, 4, 2, 8, dtype=torch.int8)
    vc = torch.zeros_like(kc)
    ksc, vsc = torch.zeros(3, 4, 2), torch.zeros(3, 4, 2)
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    k[2, 1] = 0.0  # an all-zero row stays zero (no division by zero)
    slots = torch.tensor([11, 0, 5, 6, 2, 9])
    ref.write_kv(kc, vc, k, v, slots, "int8", 1.0, 1.0, ksc, vsc)
    for x, c, sc in ((k, kc, ksc), (v, vc, vsc)):
        s = sc.view(12, 2)[slots]
        torch.testing.assert_close(s, x.abs().amax(-1) / 127)
        codes = c.view(12, 2, 8)[slots].float()
        assert codes.abs().max() <= 127
        assert ((codes * s[..., None] - x).abs() <= s[..., None] / 2 + 1e-6).all()
    assert (kc.view(12, 2, 8)[5, 1] == 0).all()  # slot of k[2]


def test_int4_blocks_are_llama_cpp_q4_0():
    """The int4 cache's rows are byte for byte the gguf package's Q4_0 blocks (its reference
    quantizer), and read back as its dequantizer reads them: zero blocks, ties of magnitude (the
    first wins), a block whose largest value is negative, tiny and huge scales."""
    from gguf import GGMLQuantizationType as T, quants
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 3, 64, generator=g) * torch.exp2(torch.randint(-12, 12, (40, 3, 1), generator=g).float())
    x[0, 0, :32] = 0.0
    x[1, 0, :32] = 1.0
    x[1, 0, 7], x[1, 0, 9] = -4.0, 4.0
    x[2, 1, 40] = -1e4
    x[3, 2, :] = torch.arange(64) - 31.5
    got = ref.quantize_q4(x)
    assert got.dtype == torch.uint8 and got.shape == (40, 3, 36)
    want = quants.quantize(x.numpy().reshape(-1, 64), T.Q4_0)
    assert (got.numpy().reshape(want.shape) == want).all()
    back = ref.dequantize_q4(got, torch.float32)
    assert torch.equal(back, torch.from_numpy(quants.dequantize(want, T.Q4_0)).reshape(x.shape))
    # the error bound of a q4_0 block: half a step (|d|) inside, one step at the clipped +8 end
    d = (x.reshape(40, 3, 2, 32).abs().amax(-1, keepdim=True) / 8).expand(40, 3, 2, 32).reshape(x.shape)
    assert ((back - x).abs() <= d * 1.001 + 1e-30).all()


def test_write_kv_int4_blocks_at_their_slots():
    kc, vc = (torch.zeros(3, 4, 2, 36, dtype=torch.uint8) for _ in range(2))
    k, v = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    slots = torch.tensor([11, 0, -1, 6, 2])
    ref.write_kv(kc, vc, k, v, slots, "int4", 1.0, 1.0)
    keep = slots >= 0
    for x, c in ((k, kc), (v, vc)):
        assert torch.equal(c.view(12, 2, 36)[slots[keep]], ref.quantize_q4(x[keep]))
    written = torch.zeros(12, dtype=torch.bool)
    written[slots[keep]] = True
    assert (kc.view(12, -1)[~written] == 0).all()


def test_int8_needs_scale_caches():
    b = _batch([(4, 1)], 2, 2, 8, 4)
    with pytest.raises(UserInputError):
        ref.write_kv(b.key_cache, b.value_cache, b.k_new, b.v_new, b.slot_mapping, "int8", 1.0, 1.0)


def test_rms_norm():
    x = torch.randn(5, 32)
    w = torch.randn(32)
    want = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(ref.rms_norm(x, w, 1e-6).double(), want, atol=1e-5, rtol=1e-5)


def test_rotary_is_a_complex_rotation():
    n, d = 6, 16
    q, k = torch.randn(n, 3, d, dtype=torch.float64), torch.randn(n, 1, d, dtype=torch.float64)
    theta = torch.rand(n, d // 2, dtype=torch.float64) * 10
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)
    rq, rk = ref.rotary(q, k, cos, sin)
    for x, got in ((q, rq), (k, rk)):
        z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.polar(torch.ones_like(theta), theta)[:, None, :]
        torch.testing.assert_close(got, torch.cat([z.real, z.imag], -1))


def test_kv_dtypes_and_block_bytes():
    assert ref.kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert ref.kv_cache_torch_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    assert ref.kv_cache_torch_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert ref.kv_cache_torch_dtype("int8", torch.float32) == torch.int8
    with pytest.raises(UserInputError):
        ref.kv_cache_torch_dtype("fp4", torch.float32)
    # SmolLM2: 3 kv heads x 64 dims, block 16
    assert ref.kv_block_bytes(16, 3, 64, "auto", torch.float32) == 2 * 16 * 3 * 64 * 4
    assert ref.kv_block_bytes(16, 3, 64, "fp8", torch.float32) == 2 * 16 * 3 * 64
    assert ref.kv_block_bytes(16, 3, 64, "int8", torch.float32) == 2 * 16 * 3 * 64 + 2 * 16 * 3 * 4
    assert ref.kv_cache_torch_dtype("int4", torch.float32) == torch.uint8
    assert ref.kv_block_bytes(16, 3, 64, "int4", torch.float32) == 2 * 16 * 3 * (64 // 32 * 18)   # 4.5 bits a value
    with pytest.raises(UserInputError, match="head_dim is 40"):
        ref.kv_block_bytes(16, 3, 40, "int4", torch.float32)


def test_dispatch_backends():
    """The backend is an argument of every entry point: no module state to set or leak."""
    b = _batch([(9, 3), (4, 1)], 4, 2, 8, 4, seed=1)
    want = run_paged(ref.paged_attention, b, 0.4, None)
    for name in ("auto", "torch"):  # auto on CPU tensors = the reference
        got = run_paged(lambda *a: kernels.paged_attention(*a, backend=name), b, 0.4, None)
        torch.testing.assert_close(got, want)
    assert kernels.resolve_backend("auto", "cpu") == "torch" and kernels.resolve_backend("torch", "cpu") == "torch"
    with pytest.raises(UserInputError, match="unknown attention backend"):
        kernels.resolve_backend("cuda-graphs", "cpu")
    with pytest.raises(UserInputError, match="unknown attention backend"):
        kernels.rms_norm(b.q, torch.ones(8), 1e-6, backend="cuda-graphs")
    torch.testing.assert_close(kernels.rms_norm(b.q, torch.ones(8), 1e-6, backend="torch"),
                               ref.rms_norm(b.q, torch.ones(8), 1e-6))
    assert not hasattr(kernels, "set_backend") and not hasattr(kernels, "get_backend")


def test_gpu_check_without_cuda_exits_with_one_line():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0]
