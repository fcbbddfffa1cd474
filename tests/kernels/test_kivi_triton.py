"""The Triton paged attention on kivi2 caches (2-bit pages for each sequence's first quant_blocks
blocks, a full-precision residual after them; llmopt/kernels/kivi.py), on the CPU under
TRITON_INTERPRET=1: decode and varlen kernels against a float64 attention over the dequantized rows,
and against the reference path; and an ahead-of-time compile of the kivi2 variants for sm_90 (what
the interpreter cannot check; scripts/gpu_check.py --compile covers the other KV modes).

Page ids and residual ids are drawn from overlapping ranges, so reading a block from the wrong space
reads other data; unused pages and residual slots hold NaN garbage (0x7F bytes: fp16 NaN scales),
which the kernels must never load. TRITON_INTERPRET must be set before a kernel is decorated (see
tests/kernels/test_kernels.py).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from llmopt import kernels  # noqa: E402
from llmopt.cache.kivi import key_page_bytes, value_page_bytes  # noqa: E402
from llmopt.errors import UserInputError  # noqa: E402
from llmopt.kernels import kivi  # noqa: E402
from llmopt.kernels import reference as ref  # noqa: E402
from llmopt.kernels import triton_attention, triton_attention_kernels  # noqa: E402

if not isinstance(triton_attention_kernels._decode_kernel, InterpretedFunction):
    for mod in (triton_attention_kernels, triton_attention):
        importlib.reload(mod)

ROOT = Path(__file__).resolve().parents[2]
SCALE = 0.3
F32, BF16 = torch.float32, torch.bfloat16
# (context_len, query_len, quant_blocks): no pages, some, every full block (64 and 32: no residual left)
DECODE32 = [(1, 1, 0), (32, 1, 1), (45, 1, 1), (64, 1, 2), (96, 1, 1), (70, 1, 0), (70, 1, 2)]
DECODE16 = [(1, 1, 0), (16, 1, 1), (40, 1, 2), (48, 1, 3), (33, 1, 0)]
# prefill chunks after a cached prefix (some of it in pages), a whole prefill, decode rows, and queries
# whose own keys sit in pages
MIXED32 = [(40, 8, 1), (64, 64, 0), (1, 1, 0), (70, 1, 2), (96, 20, 2), (64, 10, 2), (50, 18, 0)]
MIXED16 = [(20, 4, 1), (48, 48, 0), (50, 1, 3), (40, 9, 2), (3, 1, 0)]


@dataclass
class KiviBatch:
    q: torch.Tensor
    key_cache: torch.Tensor       # residual [num_residual_blocks, G, Hkv, D]
    value_cache: torch.Tensor
    key_pages: torch.Tensor       # uint8 [num_pages, Hkv, key_page_bytes]
    value_pages: torch.Tensor
    quant_blocks: torch.Tensor    # int32 [S]
    block_tables: torch.Tensor    # int32 [S, max_blocks + 1], -1 padded
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    specs: list
    group: int


def make_kivi_batch(specs, hq, hkv, d, g, res_dtype=F32, q_dtype=F32, seed=0, garbage="nan") -> KiviBatch:
    """Random keys (channel offsets, as real keys have) and values; block b of sequence s quantized
    into a page when b < quant_blocks[s], else written to a residual block. The same seed gives the
    same data whatever the garbage ("nan" for Triton, "big" finite values for the reference)."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = [-(-ctx // g) for ctx, _, _ in specs]
    assert all(qb <= ctx // g for ctx, _, qb in specs)
    n_pages = sum(qb for _, _, qb in specs) + 2
    n_res = sum(nb - qb for nb, (_, _, qb) in zip(nblocks, specs)) + 2
    page_ids, res_ids = torch.randperm(n_pages, generator=gen).tolist(), torch.randperm(n_res, generator=gen).tolist()
    key_pages = torch.full((n_pages, hkv, key_page_bytes(g, d)), 0x7F, dtype=torch.uint8)
    value_pages = torch.full((n_pages, hkv, value_page_bytes(g, d)), 0x7F, dtype=torch.uint8)
    fill = float("nan") if garbage == "nan" else 1e4
    key_cache = torch.full((n_res, g, hkv, d), fill, dtype=res_dtype)
    value_cache = torch.full((n_res, g, hkv, d), fill, dtype=res_dtype)
    tables = torch.full((len(specs), max(nblocks) + 1), -1, dtype=torch.int32)
    qs = []
    for s, ((ctx, n, qb), nb) in enumerate(zip(specs, nblocks)):
        k = torch.randn(nb * g, hkv, d, generator=gen) + 2 * torch.randn(hkv, d, generator=gen)
        v = torch.randn(nb * g, hkv, d, generator=gen)
        qs.append(torch.randn(n, hq, d, generator=gen))
        for b in range(nb):
            rows = slice(b * g, min((b + 1) * g, ctx))
            if b < qb:
                i = page_ids.pop()
                key_pages[i] = kivi.quantize_keys(k[None, rows])[0]
                value_pages[i] = kivi.quantize_values(v[None, rows])[0]
            else:
                i = res_ids.pop()
                key_cache[i, :rows.stop - rows.start] = k[rows].to(res_dtype)
                value_cache[i, :rows.stop - rows.start] = v[rows].to(res_dtype)
            tables[s, b] = i
    qsl = torch.zeros(len(specs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([n for _, n, _ in specs]), 0)
    return KiviBatch(torch.cat(qs).to(q_dtype), key_cache, value_cache, key_pages, value_pages,
                     torch.tensor([qb for _, _, qb in specs], dtype=torch.int32), tables,
                     torch.tensor([ctx for ctx, _, _ in specs], dtype=torch.int32), qsl, list(specs), g)


def run(fn, b: KiviBatch, window=None, quant_blocks=None, **knobs):
    pages = (b.key_pages, b.value_pages, b.quant_blocks if quant_blocks is None else quant_blocks)
    return fn(b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc, SCALE, window,
              "kivi2", 1.0, 1.0, None, None, pages=pages, **knobs)


def dense_rows(b: KiviBatch, s: int):
    """Sequence s's keys and values [ctx, Hkv, D] in float64: dequantized pages, then residual rows."""
    ctx, _, qb = b.specs[s]
    g, d = b.group, b.key_cache.shape[-1]
    ks, vs = [], []
    for blk in range(-(-ctx // g)):
        i = int(b.block_tables[s, blk])
        if blk < qb:
            ks.append(kivi.dequantize_keys(b.key_pages[i:i + 1], g, d, torch.float64)[0])
            vs.append(kivi.dequantize_values(b.value_pages[i:i + 1], g, d, torch.float64)[0])
        else:
            ks.append(b.key_cache[i].double())
            vs.append(b.value_cache[i].double())
    return torch.cat(ks)[:ctx], torch.cat(vs)[:ctx]


def oracle(b: KiviBatch, window=None) -> torch.Tensor:
    """float64 causal (+window) GQA softmax attention of each sequence's queries over its rows."""
    outs = []
    start = 0
    for s, (ctx, n, _) in enumerate(b.specs):
        k, v = dense_rows(b, s)
        q = b.q[start:start + n].double()
        start += n
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)   # head h reads kv head h // group
        scores = torch.einsum("ihd,jhd->hij", q, k) * SCALE
        i, j = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :]
        allowed = (j <= i) if window is None else (j <= i) & (i - j < window)
        p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
        outs.append(torch.einsum("hij,jhd->ihd", p, v))
    return torch.cat(outs)


def _check(specs, hq, hkv, d, g, res_dtype, q_dtype, seed, window=None, **knobs):
    b = make_kivi_batch(specs, hq, hkv, d, g, res_dtype, q_dtype, seed)
    got = run(triton_attention.paged_attention, b, window, **knobs)
    assert got.dtype == q_dtype and torch.isfinite(got).all()
    tol = 2e-2 if q_dtype == BF16 else 1e-5   # bf16: the output's rounding (the interpreter truncates)
    torch.testing.assert_close(got.double(), oracle(b, window), atol=tol, rtol=tol)
    want = run(ref.paged_attention, make_kivi_batch(specs, hq, hkv, d, g, res_dtype, q_dtype, seed, "big"), window)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    return b, got


@pytest.mark.parametrize("hq,hkv,d,g,res_dtype,q_dtype,splits,block_n", [
    (4, 2, 64, 32, F32, F32, 1, None),     # tiles of 16 inside a block
    (4, 2, 64, 32, BF16, F32, 3, 64),      # tiles of 64 straddle two blocks: pages and residual in one tile
    (3, 1, 32, 32, F32, F32, 2, 32),
    (3, 1, 32, 32, BF16, BF16, 1, None),
    (4, 2, 64, 16, F32, F32, 2, None),     # G 16: four value groups per head
])
def test_decode(hq, hkv, d, g, res_dtype, q_dtype, splits, block_n):
    specs = DECODE32 if g == 32 else DECODE16
    _check(specs, hq, hkv, d, g, res_dtype, q_dtype, seed=hq + d + splits, num_splits=splits, block_n=block_n)


@pytest.mark.parametrize("hq,hkv,d,g,res_dtype,q_dtype,block_n", [
    (4, 2, 64, 32, F32, F32, None),
    (3, 1, 32, 32, BF16, F32, 64),
    (4, 2, 32, 32, BF16, BF16, None),
    (3, 1, 64, 16, F32, F32, 32),
])
def test_varlen(hq, hkv, d, g, res_dtype, q_dtype, block_n):
    specs = MIXED32 if g == 32 else MIXED16
    _check(specs, hq, hkv, d, g, res_dtype, q_dtype, seed=hq * d, block_n=block_n)


def test_sliding_window():
    _check(DECODE32, 4, 2, 32, 32, F32, F32, seed=3, window=20, num_splits=2)
    _check(MIXED32[:5], 4, 2, 32, 32, F32, F32, seed=4, window=20, block_n=32)


@pytest.mark.filterwarnings("ignore:All-NaN slice")   # a block misread as a page reads a garbage page
def test_wrong_quant_blocks_are_seen():
    """The checks can fail: one block of one sequence read from the other space gives other rows."""
    b, got = _check(DECODE32[:4], 4, 2, 32, 32, F32, F32, seed=9)
    want = oracle(b)
    for delta in (-1, 1):   # sequence 2 (45 tokens, 1 page): no pages, or its residual block as a page
        qb = b.quant_blocks.clone()
        qb[2] += delta
        wrong = run(triton_attention.paged_attention, b, quant_blocks=qb).double()
        assert not torch.allclose(wrong[2], want[2], atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(wrong[:2], got[:2].double())   # the others unchanged


def test_dispatch_reaches_triton_with_pages(monkeypatch):
    b = make_kivi_batch(MIXED32[:3], 4, 2, 32, 32, seed=5)
    calls = []
    real = triton_attention.paged_attention
    monkeypatch.setattr(triton_attention, "paged_attention", lambda *a, **k: calls.append(k) or real(*a, **k))
    got = run(lambda *a, **k: kernels.paged_attention(*a, backend="triton", **k), b)
    assert len(calls) == 1 and calls[0]["pages"][2] is b.quant_blocks
    torch.testing.assert_close(got.double(), oracle(b), atol=1e-5, rtol=1e-5)


def test_bad_pages_are_refused():
    b = make_kivi_batch(DECODE32[:2], 4, 2, 32, 32, seed=6)
    short = b.key_pages[..., :-4].contiguous()
    with pytest.raises(UserInputError, match="key pages"):
        triton_attention.paged_attention(b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                                         b.query_start_loc, SCALE, None, "kivi2", 1.0, 1.0,
                                         pages=(short, b.value_pages, b.quant_blocks))
    with pytest.raises(UserInputError, match="quant_blocks"):
        run(triton_attention.paged_attention, b, quant_blocks=b.quant_blocks[:1])


COMPILE_KIVI = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmopt.kernels import triton_attention_kernels as K
ptrs = {"bt_ptr": "i32", "lens_ptr": "i32", "qsl_ptr": "i32", "qb_ptr": "i32", "ks_ptr": "u8", "vs_ptr": "u8",
        "part_ptr": "fp32", "ml_ptr": "fp32"}
decode = dict(HKV=2, D=128, D_PAD=128, PAGE=32, BLOCK_N=64, KV_MODE=K.KV_KIVI, USE_WINDOW=False, DOT_IEEE=False,
              G=4, G_PAD=16, SPLIT=True)
varlen = dict(HKV=2, D=64, D_PAD=64, PAGE=16, BLOCK_N=64, KV_MODE=K.KV_KIVI, USE_WINDOW=True, DOT_IEEE=False,
              G=4, BLOCK_M=64, BLOCK_Q=16)
for kernel, cx, qdt in ((K._decode_kernel, decode, "bf16"), (K._varlen_kernel, varlen, "fp16")):
    sig = {n: "constexpr" if n in cx else "*" + ptrs.get(n, qdt) if n.endswith("_ptr")
           else "fp32" if n in ("k_scale", "v_scale", "qk_scale") else "i32" for n in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=cx), target=GPUTarget("cuda", 90, 32))
    assert compiled.asm.get("cubin"), kernel
print("compiled")
"""


def test_kivi_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "-c", COMPILE_KIVI], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stdout + r.stderr
