"""Every Triton kernel against the PyTorch reference, on the CPU under TRITON_INTERPRET=1, plus an
ahead-of-time compile of the kernels for sm_90 (scripts/gpu_check.py --compile: what the interpreter
cannot check), and the dispatch by an explicit backend argument.

TRITON_INTERPRET must be set before a kernel is decorated, so it is set here, before any triton
import, and the kernel modules are reloaded if something imported them earlier without it.
Note: the interpreter truncates float32 -> bfloat16 casts (a GPU rounds to nearest even), so bf16
results are compared within a couple of bf16 ulps; exact comparisons use float32.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from llmopt import kernels  # noqa: E402
from llmopt.errors import UserInputError  # noqa: E402
from llmopt.kernels import reference as ref  # noqa: E402
from llmopt.kernels import triton_attention, triton_attention_kernels, triton_kv, triton_norm  # noqa: E402
from paged_batch import empty_cache, make_batch, run_paged  # noqa: E402

if not isinstance(triton_attention_kernels._decode_kernel, InterpretedFunction):
    for mod in (triton_attention_kernels, triton_attention, triton_kv, triton_norm):
        importlib.reload(mod)

ROOT = Path(__file__).resolve().parents[2]
# (context_len, query_len): decode rows mixed with prefill and extend; ends on and off 16-boundaries
MIXED = [(1, 1), (16, 1), (37, 3), (16, 16), (23, 23), (40, 7), (32, 16)]
DECODE = [(1, 1), (16, 1), (17, 1), (40, 1), (32, 1)]


def _check(specs, hq, hkv, d, block_size, window, knobs=None, **kw):
    """Triton on a cache full of NaN garbage, the reference on the same data with finite garbage."""
    b = make_batch(specs, hq, hkv, d, block_size, garbage="nan", **kw)
    got = run_paged(lambda *a: triton_attention.paged_attention(*a, **(knobs or {})), b, 0.3, window)
    want = run_paged(ref.paged_attention, make_batch(specs, hq, hkv, d, block_size, garbage="big", **kw), 0.3, window)
    assert got.dtype == b.q.dtype and torch.isfinite(got).all()
    tol = 2e-2 if b.q.dtype == torch.bfloat16 else 2e-6
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("hq,hkv,block_size,kv_dtype,window", [
    (3, 1, 16, "auto", None),
    (8, 2, 1, "fp8", 5),
    (2, 2, 16, "int8", None),
    (6, 2, 1, "fp8_e5m2", None),
    (4, 1, 16, "fp8_e4m3", 9),
    (4, 2, 16, "bfloat16", None),   # a 16-bit cache under a float32 model: rows cast, read widened
    (6, 2, 16, "int4", 5),
])
def test_varlen_prefill_extend_attention(hq, hkv, block_size, kv_dtype, window):
    d = 64 if kv_dtype == "int4" else 16   # int4: q4_0 blocks of 32 along the head
    _check(MIXED, hq, hkv, d, block_size, window, kv_dtype=kv_dtype, seed=hq + block_size, k_scale=0.5, v_scale=2.0)


@pytest.mark.parametrize("hq,hkv,block_size,kv_dtype,window,splits", [
    (8, 2, 16, "int8", None, 1),
    (6, 2, 1, "fp8", 7, 3),
    (2, 2, 16, "auto", None, 2),
    (3, 1, 16, "fp8_e5m2", None, 1),
    (4, 2, 16, "float16", 6, 2),
    (4, 1, 1, "int4", None, 2),
])
def test_decode_attention(hq, hkv, block_size, kv_dtype, window, splits):
    d = 32 if kv_dtype == "int4" else 16
    _check(DECODE, hq, hkv, d, block_size, window, {"num_splits": splits}, kv_dtype=kv_dtype, seed=hq * 7 + splits,
           k_scale=0.25)


def test_bfloat16_and_head_dim_not_a_power_of_two():
    _check(MIXED[:4], 6, 2, 24, 16, None, dtype=torch.bfloat16, seed=5)
    _check(DECODE[:3], 6, 2, 24, 16, 4, {"num_splits": 2}, dtype=torch.bfloat16, seed=6)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "fp8_e5m2", "int8", "bfloat16", "float16", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference_bytes(kv_dtype, dtype):
    d = 32 if kv_dtype == "int4" else 8
    a = empty_cache(5, 4, 3, d, kv_dtype, dtype, "cpu")
    b = tuple(None if x is None else x.clone() for x in a)
    k = (torch.randn(7, 5, d) * 3).to(dtype)[:, 1:4]  # a strided view, as from a fused qkv projection
    v = torch.randn(7, 3, d).to(dtype)
    slots = torch.tensor([0, 19, 5, -1, 7, 12, 3])
    ref.write_kv(a[0], a[1], k, v, slots, kv_dtype, 0.5, 0.25, a[2], a[3])
    triton_kv.write_kv(b[0], b[1], k, v, slots, kv_dtype, 0.5, 0.25, b[2], b[3])
    for x, y in zip(a, b):
        if x is not None:  # byte-identical, NaN garbage in the untouched slots included
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_rms_norm():
    x, w = torch.randn(4, 3, 40), torch.randn(40)
    torch.testing.assert_close(triton_norm.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    torch.testing.assert_close(triton_norm.rms_norm(xb, wb, 1e-5).float(), ref.rms_norm(xb, wb, 1e-5).float(),
                               atol=0.1, rtol=2 ** -6)


def test_rotary_on_strided_views():
    qkv = torch.randn(5, (6 + 2 + 2) * 12)
    q = qkv[:, :72].view(5, 6, 12)
    k = qkv[:, 72:96].view(5, 2, 12)
    theta = torch.rand(5, 6) * 20
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)
    for got, want in zip(triton_norm.rotary(q, k, cos, sin), ref.rotary(q, k, cos, sin)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_dispatch_to_triton(monkeypatch):
    b = make_batch([(9, 3), (4, 1)], 4, 2, 16, 4, seed=2, garbage="big")
    calls = []
    real = triton_attention.paged_attention
    monkeypatch.setattr(triton_attention, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    triton_paged = lambda *a: kernels.paged_attention(*a, backend="triton")  # noqa: E731
    got = run_paged(triton_paged, b, 0.4, None)
    assert calls == [1]
    torch.testing.assert_close(got, run_paged(ref.paged_attention, b, 0.4, None), atol=2e-6, rtol=2e-6)
    run_paged(lambda *a: kernels.paged_attention(*a, backend="torch"), b, 0.4, None)
    assert calls == [1]  # the torch backend never reaches the Triton module
    assert kernels.resolve_backend("triton", "cpu") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(UserInputError, match="CUDA"):
        run_paged(triton_paged, b, 0.4, None)
    with pytest.raises(UserInputError, match="CUDA"):
        kernels.resolve_backend("triton", "cpu")


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])  # qwen3: the q/k RMSNorms too
def test_model_forward_through_fused_kernels(tiny_factory, monkeypatch, model_type):
    """The model's RMSNorm and RoPE take the Triton path when the attention context carries the
    triton backend (and only then): same hidden states."""
    from llmopt.models.attention import DenseCausalAttention
    from llmopt.models.loader import load_model
    path = tiny_factory(model_type=model_type, vocab_size=128, hidden_size=48, intermediate_size=64,
                        num_attention_heads=6, head_dim=8, max_position_embeddings=64)
    model = load_model(str(path), "float32", "cpu", tokenizer=False).model
    calls = {"rms_norm": 0, "rotary": 0}
    for name in calls:
        real = getattr(triton_norm, name)
        monkeypatch.setattr(triton_norm, name, lambda *a, _n=name, _r=real: calls.__setitem__(_n, calls[_n] + 1) or _r(*a))
    ids = torch.randint(0, 128, (2, 7))
    pos = torch.arange(7)
    with torch.no_grad():
        want = model(ids, pos, DenseCausalAttention())
        assert calls == {"rms_norm": 0, "rotary": 0}
        ctx = DenseCausalAttention()
        ctx.backend = "triton"
        got = model(ids, pos, ctx)
    norms = 2 * 2 + 1 + (2 * 2 if model_type == "qwen3" else 0)  # per layer 2 (+ q/k norms), final norm
    assert calls == {"rms_norm": norms, "rotary": 2}
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--compile", "90", "--quick"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "9/9 kernel variants compiled" in r.stdout   # kivi2's decode and varlen among them
