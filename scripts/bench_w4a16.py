"""GPU check and timing of the quantized runtime (run only where CUDA is available):

1. every quantized module on CUDA (GPTQ act-order, AutoAWQ GEMM, compressed-tensors W4A16, FP8 and
   INT8 W8A8) against the same module's CPU path;
2. the Triton W4A16 kernel against a bf16 matmul (torch) at decode and prefill shapes, in µs.

    python scripts/bench_w4a16.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _time_us(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def check_modules() -> list[dict]:
    from llmopt.quant.formats import pack_linear
    from llmopt.layers.modules import AWQLinear, CTPackedLinear, GPTQLinear
    from llmopt.layers.modules_w8a8 import W8Linear
    from llmopt.layers.types import FloatQuantized, Int8Quantized, IntQuantized
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


def bench_kernel() -> list[dict]:
    from llmopt.kernels.w4a16 import w4a16_matmul
    from llmopt.layers.formats.packing import pack_codes
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
            t_q = _time_us(lambda: w4a16_matmul(x, q, s, z, gs))
            t_bf16 = _time_us(lambda: x @ w)
            rows.append({"K": K, "N": N, "M": M, "w4a16_us": round(t_q, 1), "bf16_us": round(t_bf16, 1),
                         "speedup": round(t_bf16 / t_q, 2), "rel_err": err})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 1
    result = {"device": torch.cuda.get_device_name(), "modules": check_modules(), "kernel": bench_kernel()}
    if a.json:
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


if __name__ == "__main__":
    sys.exit(main())
