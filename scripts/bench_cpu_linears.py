"""The C++ decode layer's kernels on this CPU (issue #14), against torch in the same run.

For each row count M: the int8-activation kernels (`llmopt_cpu::idot_gemm`: the AVX2 path (integer
tiles, and from CPU_F32_PANEL_MIN_ROWS rows the float panels, as a CPU without VNNI runs them), VNNI
tiles, VNNI panels, switched through `llmopt_cpu::tiles_config`) on int4 and int8 codes, the float ones
(`llmopt_cpu::f32_gemm`: one weight row at a time up to CPU_F32_STREAM_MAX_ROWS rows, also timed
through the tile it replaced; the float tile below CPU_F32_PANEL_MIN_ROWS rows, the panels from there)
against MKL's `x @ w.t()`, each over `--matrices` distinct 1536 x 576 weights (streamed from memory
where they outgrow the L3), in G multiply-adds/s; then `llmopt_cpu::decode_attention` for 64 rows
over 200 keys with one distinct cache per layer, as a decode step reads them.

    python scripts/bench_cpu_linears.py
    python scripts/bench_cpu_linears.py --rows 1,2,3,4     # decode and speculative verification rows
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from llmopt import defaults  # noqa: E402
from llmopt.kernels import cpu_quant  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64", help="comma-separated M")
    ap.add_argument("--matrices", type=int, default=48)
    ap.add_argument("--group-size", type=int, default=64)
    args = ap.parse_args()
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
        kind = "panels" if config is not None and m >= f32_rows else "rows" if m <= stream_rows else "tile"
        print(f"{m:>4} {f'float32, ours ({kind})':<28} {ours * 1e3:>8.3f} {rate(ours):>8.1f}")
        if kind == "rows":   # the tile these rows took before row_f32, in the same run
            config(-1, 0, 0, 0)
            tile = best_of(lambda w: ops.f32_gemm(x, w), floats)
            config(-1, 0, 0, stream_rows)
            print(f"{m:>4} {'float32, ours (tile, before)':<28} {tile * 1e3:>8.3f} {rate(tile):>8.1f}   "
                  f"rows/tile {tile / ours:.2f}x")
        print(f"{m:>4} {'float32, MKL x @ w.t()':<28} {mkl * 1e3:>8.3f} {rate(mkl):>8.1f}   ours/MKL {mkl / ours:.2f}x")
    rows, hq, hkv, d, bs, ctx, layers = 64, 9, 3, 64, 16, 200, 30
    w = (ctx + bs - 1) // bs
    caches = [(torch.randn(rows * w, bs, hkv, d), torch.randn(rows * w, bs, hkv, d)) for _ in range(layers)]
    perm = torch.randperm(rows * w, generator=g).to(torch.int32).view(rows, w)
    lens = torch.full((rows,), ctx, dtype=torch.int32)
    q = torch.randn(rows, hq, d)
    s = best_of(lambda c: ops.decode_attention(q, c[0], c[1], perm, lens, d ** -0.5, -1), caches)
    mb = rows * ctx * hkv * d * 8 / 1e6
    print(f"attention: {rows} rows x {ctx} keys, {layers} distinct caches: {s * 1e3:.3f} ms a layer "
          f"({mb:.1f} MB of K/V, {mb / 1e3 / s:.1f} GB/s)")


if __name__ == "__main__":
    main()
