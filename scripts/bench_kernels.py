"""The kernels benchmark: llmopt's kernels against the peers they replace, in one run, one mode each.

`attention` (CPU): one decode step of one layer with SmolLM2-135M's attention shape (9 query heads, 3 kv
  heads, head dim 64, float32), N sequences with contexts drawn from [min, max]:
  - llmopt reference: write the new K/V into 16-token blocks (random block order), then varlen paged
    attention (gathers each sequence's blocks);
  - transformers-style: a padded contiguous [N, kv heads, L, D] cache extended by torch.cat, as
    DynamicCache does every step, then SDPA with a padding mask;
  - the SDPA alone on that contiguous cache (a floor: no cache update at all).
`linears` (CPU): the C++ decode layer's kernels against torch. For each row count M: the int8-activation
  kernels (`llmopt_cpu::idot_gemm`: the AVX2 path (integer tiles, and from CPU_F32_PANEL_MIN_ROWS rows the
  float panels, as a CPU without VNNI runs them), VNNI tiles, VNNI panels, switched through
  `llmopt_cpu::tiles_config`) on int4 and int8 codes, the float ones (`llmopt_cpu::f32_gemm`: one weight
  row at a time up to CPU_F32_STREAM_MAX_ROWS rows, also timed through the tile it replaced; the float
  tile below CPU_F32_PANEL_MIN_ROWS rows, from there to CPU_F32_BCAST_MAX_ROWS the weights broadcast as
  stored, also timed through the float panels they replaced, the panels beyond) against MKL's `x @ w.t()`, each over
  `--matrices` distinct 1536 x 576 weights (streamed from memory where they outgrow the L3), in G
  multiply-adds/s; then `llmopt_cpu::decode_attention` for 64 rows over 200 keys with one distinct cache
  per layer, as a decode step reads them, for float32, bfloat16, float16 and int8 caches.
`w4a16` (CUDA only): every quantized module on CUDA (GPTQ act-order, AutoAWQ GEMM, compressed-tensors
  W4A16, FP8 and INT8 W8A8) against the same module's CPU path; then the Triton W4A16 kernel against a
  bf16 matmul at decode and prefill shapes, in us (median of 50).

    python scripts/bench_kernels.py attention --threads 1
    python scripts/bench_kernels.py linears [--rows 1,2,3,4]      # decode and speculative verification rows
    python scripts/bench_kernels.py w4a16 [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch
import torch.nn.functional as F

from benchlib import median_seconds, paged_batch
from llmopt import defaults
from llmopt.kernels import cpu_quant, reference as ref
from llmopt.quant.formats import pack_linear
from llmopt.layers.formats.packing import pack_codes
from llmopt.layers.modules import AWQLinear, CTPackedLinear, GPTQLinear
from llmopt.layers.modules_w8a8 import W8Linear
from llmopt.layers.types import FloatQuantized, Int8Quantized, IntQuantized


# -- attention ----------------------------------------------------------------------------------------

def timed(fn, iters: int) -> float:
    """Mean seconds of fn() over `iters` calls after one."""
    fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def attention(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    hq, hkv, d, bs = 9, 3, 64, 16
    rng = random.Random(0)
    lens = [rng.randint(args.min_context, args.max_context) for _ in range(args.seqs)]
    b = paged_batch().make_batch([(n, 1) for n in lens], hq, hkv, d, bs, garbage="big", extra_blocks=0)
    b.key_cache[b.key_cache.abs() > 1e3] = 0  # zero-initialized, as the engine allocates
    b.value_cache[b.value_cache.abs() > 1e3] = 0
    newest = torch.cumsum(torch.tensor(lens), 0) - 1  # each sequence's decode token
    k_new, v_new, slots = b.k_new[newest], b.v_new[newest], b.slot_mapping[newest]
    scale = d ** -0.5

    def paged():
        ref.write_kv(b.key_cache, b.value_cache, k_new, v_new, slots, "auto", 1.0, 1.0)
        return ref.paged_attention(b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc,
                                   scale, None, "auto", 1.0, 1.0)

    # contiguous, left-padded cache of the previous tokens, as transformers keeps it
    width = max(lens) - 1
    kc = torch.zeros(args.seqs, hkv, width, d)
    vc = torch.zeros_like(kc)
    mask = torch.zeros(args.seqs, width + 1, dtype=torch.bool)
    for s, (n, k, v) in enumerate(zip(lens, b.k_new.split(lens), b.v_new.split(lens))):
        kc[s, :, width - (n - 1):] = k[:-1].transpose(0, 1)
        vc[s, :, width - (n - 1):] = v[:-1].transpose(0, 1)
        mask[s, width - (n - 1):] = True
    q = b.q.view(args.seqs, hq, 1, d)

    def contiguous_cat():
        k = torch.cat([kc, k_new[:, :, None]], dim=2)
        v = torch.cat([vc, v_new[:, :, None]], dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None], scale=scale, enable_gqa=True)

    kfull = torch.cat([kc, k_new[:, :, None]], dim=2)
    vfull = torch.cat([vc, v_new[:, :, None]], dim=2)

    def sdpa_only():
        return F.scaled_dot_product_attention(q, kfull, vfull, attn_mask=mask[:, None, None], scale=scale,
                                              enable_gqa=True)

    want = sdpa_only().view(args.seqs, hq, d)
    assert torch.allclose(paged(), want, atol=1e-5), "paged reference disagrees with dense SDPA"
    t_p, t_c, t_s = (timed(f, args.iters) for f in (paged, contiguous_cat, sdpa_only))
    kv_mb = sum(lens) * hkv * d * 4 * 2 / 2**20
    print(f"{args.seqs} sequences, contexts {args.min_context}-{args.max_context} (K+V {kv_mb:.1f} MiB per layer), "
          f"torch threads {torch.get_num_threads()}")
    print("| path (one layer, one decode step) | ms | vs paged reference |")
    print("|---|---:|---:|")
    for name, t in (("llmopt paged reference (write_kv + paged_attention)", t_p),
                    ("transformers-style cat + SDPA", t_c), ("SDPA on a ready contiguous cache", t_s)):
        print(f"| {name} | {t * 1e3:.2f} | {t / t_p:.2f}x |")



# -- linears ------------------------------------------------------------------------------------------

def best_of(fn, items, reps: int = 5) -> float:
    """Seconds per item: the best of `reps` passes over all items."""
    fn(items[0])
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for it in items:
            fn(it)
        best = min(best, (time.perf_counter() - t) / len(items))
    return best


def linears(args) -> None:
    ops = cpu_quant.ops()
    if ops is None:
        sys.exit("the C++ kernels are not available")
    config = ops.tiles_config if hasattr(ops, "tiles_config") else None
    f32_rows = getattr(defaults, "CPU_F32_PANEL_MIN_ROWS", 32)
    isas = {"tiles": None}   # an older checkout (no switch): its one kernel
    if config is not None:
        isas = {"AVX2 path": (0, 10**6)}   # tiles, and from CPU_F32_PANEL_MIN_ROWS rows the float panels
        try:
            config(1)
            isas |= {"VNNI tiles": (1, 10**6), "VNNI panels": (1, 1)}
        except RuntimeError:
            pass
    n, k, gs, g = 1536, 576, args.group_size, torch.Generator().manual_seed(0)
    weights = {
        "int4": [(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), 2) for _ in range(args.matrices)],
        "int8": [(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), 1) for _ in range(args.matrices)],
    }
    scales, szeros = torch.rand(n, k // gs, generator=g) * 0.01, torch.rand(n, k // gs, generator=g) * 0.01
    floats = [torch.randn(n, k, generator=g) for _ in range(args.matrices)]
    print(f"{n} x {k}, group {gs}, {args.matrices} distinct matrices; G multiply-adds/s (higher is better)")
    print(f"{'M':>4} {'kernel':<28} {'ms':>8} {'G/s':>8}")
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, k, generator=g)
        rate = lambda s: m * n * k / s / 1e9  # noqa: E731
        for codes, ws in weights.items():
            for name, switch in isas.items():
                if switch is not None:
                    config(*switch)
                s = best_of(lambda w: ops.idot_gemm(x, w[0], scales, szeros, gs, w[1], True), ws)
                print(f"{m:>4} {f'int8 x {codes}, {name}':<28} {s * 1e3:>8.3f} {rate(s):>8.1f}")
        if config is not None:
            config(-1, defaults.CPU_IDOT_PANEL_MIN_ROWS, f32_rows)
        stream_rows = getattr(defaults, "CPU_F32_STREAM_MAX_ROWS", 0)
        ours = best_of(lambda w: ops.f32_gemm(x, w), floats)
        mkl = best_of(lambda w: x @ w.t(), floats)
        bcast_rows = getattr(defaults, "CPU_F32_BCAST_MAX_ROWS", 0)
        kind = ("bcast" if config is not None and f32_rows <= m <= bcast_rows else
                "panels" if config is not None and m >= f32_rows else "rows" if m <= stream_rows else "tile")
        rounds = []
        if kind == "bcast":   # the float panels these rows took before f32_bcast: 5 rounds alternating
            for _ in range(5):
                config(-1, 0, 0, -1, -1, 0)
                panels = best_of(lambda w: ops.f32_gemm(x, w), floats, reps=3)
                config(-1, 0, 0, -1, -1, bcast_rows)
                rounds.append((panels, best_of(lambda w: ops.f32_gemm(x, w), floats, reps=3)))
            ours = min([ours] + [b for _, b in rounds])
        print(f"{m:>4} {f'float32, ours ({kind})':<28} {ours * 1e3:>8.3f} {rate(ours):>8.1f}")
        if rounds:
            ratios = sorted(p / b for p, b in rounds)
            panels = min(p for p, _ in rounds)
            print(f"{m:>4} {'float32, ours (panels, before)':<28} {panels * 1e3:>8.3f} {rate(panels):>8.1f}   "
                  f"bcast/panels {ratios[0]:.2f}-{ratios[-1]:.2f}x (5 rounds alternating)")
        if kind == "rows":   # the tile these rows took before row_f32, in the same run
            config(-1, 0, 0, 0)
            tile = best_of(lambda w: ops.f32_gemm(x, w), floats)
            config(-1, 0, 0, stream_rows)
            print(f"{m:>4} {'float32, ours (tile, before)':<28} {tile * 1e3:>8.3f} {rate(tile):>8.1f}   "
                  f"rows/tile {tile / ours:.2f}x")
        print(f"{m:>4} {'float32, MKL x @ w.t()':<28} {mkl * 1e3:>8.3f} {rate(mkl):>8.1f}   ours/MKL {mkl / ours:.2f}x")
    rows, hq, hkv, d, bs, ctx, layers = 64, 9, 3, 64, 16, 200, 30
    w = (ctx + bs - 1) // bs
    perm = torch.randperm(rows * w, generator=g).to(torch.int32).view(rows, w)
    lens = torch.full((rows,), ctx, dtype=torch.int32)
    q = torch.randn(rows, hq, d)
    shape = (rows * w, bs, hkv, d)
    for kv in ("float32", "bfloat16", "float16", "int8"):   # int8: codes and per-(slot, head) scales
        if kv == "int8":
            caches = [tuple(torch.randint(-127, 128, shape, dtype=torch.int8, generator=g) for _ in "kv")
                      + tuple(torch.rand(shape[:3], generator=g) / 40 + 0.01 for _ in "kv") for _ in range(layers)]
        else:
            caches = [tuple(torch.randn(shape, generator=g).to(getattr(torch, kv)) for _ in "kv") + (None, None)
                      for _ in range(layers)]
        s = best_of(lambda c: ops.decode_attention(q, c[0], c[1], perm, lens, d ** -0.5, -1, 1.0, 1.0, c[2], c[3]),
                    caches)
        mb = rows * ctx * hkv * 2 * (d * caches[0][0].element_size() + (4 if kv == "int8" else 0)) / 1e6
        print(f"attention, {kv} cache: {rows} rows x {ctx} keys, {layers} distinct caches: {s * 1e3:.3f} ms a layer "
              f"({mb:.1f} MB of K/V, {mb / 1e3 / s:.1f} GB/s)")



# -- w4a16 --------------------------------------------------------------------------------------------

def w4a16_modules() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out, n_in, gs = 512, 1024, 128
    w = torch.randn(out, n_in, generator=g) * 0.05
    qt = IntQuantized(qweight=torch.randint(0, 16, (out, n_in), generator=g, dtype=torch.int32),
                      scales=(torch.rand(out, n_in // gs, generator=g) * 0.01).half().float(),
                      zeros=torch.randint(1, 16, (out, n_in // gs), generator=g, dtype=torch.int32),
                      bits=4, group_size=gs, sym=False)
    perm = torch.randperm(n_in, generator=g)
    act = IntQuantized(**{**qt.__dict__, "g_idx": (torch.argsort(perm) // gs).to(torch.int32)})
    s8 = w.abs().amax(1, keepdim=True) / 127
    sf = w.abs().amax(1, keepdim=True) / 448
    cases = [("gptq act-order", lambda: GPTQLinear(n_in, out, False, 4, gs, sym=False), act, "gptq"),
             ("awq", lambda: AWQLinear(n_in, out, False, 4, gs), qt, "awq"),
             ("ct w4a16 asym", lambda: CTPackedLinear(n_in, out, False, 4, gs, sym=False), qt, "compressed-tensors"),
             ("ct fp8 w8a8", lambda: W8Linear(n_in, out, False, "fp8", True, "dynamic"),
              FloatQuantized((w / sf).to(torch.float8_e4m3fn), sf, "dynamic"), "compressed-tensors"),
             ("ct int8 w8a8", lambda: W8Linear(n_in, out, False, "int8", True, "dynamic"),
              Int8Quantized(torch.round(w / s8).to(torch.int8), s8, "dynamic"), "compressed-tensors")]
    rows = []
    for name, make, q, fmt in cases:
        tensors = {k[2:]: v for k, v in pack_linear("m", q, fmt).items()}
        mods = {}
        for dev in ("cpu", "cuda"):
            m = make()
            for k, v in tensors.items():
                m._buffers[k] = v.to(dev)
            m.finish_loading()
            mods[dev] = m
        for m_rows in (1, 7, 64):
            x = torch.randn(m_rows, n_in, generator=g)
            want = mods["cpu"](x.bfloat16().float())
            got = mods["cuda"](x.cuda().bfloat16()).float().cpu()
            err = ((got - want).norm() / want.norm()).item()
            rows.append({"module": name, "M": m_rows, "rel_err": err,
                         "kernel": getattr(mods["cuda"], "_kernel", None) is not None, "ok": err < 2e-2})
    return rows


def w4a16_kernel() -> list[dict]:
    from llmopt.kernels.w4a16 import w4a16_matmul   # deferred: triton, which only this mode needs
    rows = []
    for K, N in ((4096, 4096), (4096, 14336), (14336, 4096)):
        gs = 128
        codes = torch.randint(0, 16, (K, N), device="cuda", dtype=torch.int32)
        q = pack_codes(codes, 4, dim=0)
        s = (torch.rand(K // gs, N, device="cuda") * 0.01).bfloat16()
        z = torch.full((K // gs, N), 8.0, device="cuda").bfloat16()
        w = ((codes.float() - 8) * s.float().repeat_interleave(gs, 0)).bfloat16()   # [K, N]
        for M in (1, 2, 4, 8, 16, 128):
            x = torch.randn(M, K, device="cuda").bfloat16()
            err = ((w4a16_matmul(x, q, s, z, gs).float() - (x @ w).float()).norm() / (x @ w).float().norm()).item()
            t_q = 1e6 * median_seconds(lambda: w4a16_matmul(x, q, s, z, gs), "cuda", iters=50, warmup=5)
            t_bf16 = 1e6 * median_seconds(lambda: x @ w, "cuda", iters=50, warmup=5)
            rows.append({"K": K, "N": N, "M": M, "w4a16_us": round(t_q, 1), "bf16_us": round(t_bf16, 1),
                         "speedup": round(t_bf16 / t_q, 2), "rel_err": err})
    return rows


def w4a16(args) -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 1
    result = {"device": torch.cuda.get_device_name(), "modules": w4a16_modules(), "kernel": w4a16_kernel()}
    if args.json:
        print(json.dumps(result))
    else:
        print(result["device"])
        for r in result["modules"]:
            print(f"{r['module']:16s} M={r['M']:4d} kernel={r['kernel']!s:5s} rel_err={r['rel_err']:.2e} "
                  f"{'ok' if r['ok'] else 'FAIL'}")
        print(f"{'K':>6s} {'N':>6s} {'M':>4s} {'w4a16 µs':>9s} {'bf16 µs':>8s} {'speedup':>7s}")
        for r in result["kernel"]:
            print(f"{r['K']:6d} {r['N']:6d} {r['M']:4d} {r['w4a16_us']:9.1f} {r['bf16_us']:8.1f} {r['speedup']:7.2f}")
    return 0 if all(r["ok"] for r in result["modules"]) and all(r["rel_err"] < 2e-2 for r in result["kernel"]) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("attention", help="paged reference attention + KV write against a torch.cat cache + SDPA (CPU)")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--min-context", type=int, default=32)
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p = sub.add_parser("linears", help="the C++ decode layer's GEMMs and attention against MKL (CPU)")
    p.add_argument("--rows", default="1,16,64", help="comma-separated M")
    p.add_argument("--matrices", type=int, default=48)
    p.add_argument("--group-size", type=int, default=64)
    p = sub.add_parser("w4a16", help="the quantized modules and the Triton W4A16 kernel on CUDA")
    p.add_argument("--json", action="store_true")
    args = ap.parse_args()
    return {"attention": attention, "linears": linears, "w4a16": w4a16}[args.mode](args) or 0


if __name__ == "__main__":
    sys.exit(main())
