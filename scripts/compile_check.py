"""Compile every Triton kernel ahead of time for a CUDA target, without a GPU.

The interpreter (TRITON_INTERPRET=1) checks what the kernels compute; this checks that they lower
through Triton's real compiler to a cubin (types of loop-carried values, dot shapes, bitcasts),
which the interpreter does not. Run: `python scripts/compile_check.py [arch] [--quick]` (default 90);
it prints one line per kernel variant and exits non-zero if any fails. Must run WITHOUT
TRITON_INTERPRET (an interpreted kernel cannot be compiled).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from llmopt.kernels import triton_attention_kernels as K  # noqa: E402
from llmopt.kernels import triton_kv, triton_norm  # noqa: E402

FLOAT_SCALARS = {"k_scale", "v_scale", "qk_scale", "eps"}
QUICK = {"decode bf16 kv_mode=3 split=True", "varlen fp32 kv_mode=0", "varlen bf16 kv_mode=1", "merge", "write_kv u8",
         "rms_norm bf16", "rotary bf16"}


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
    return out


def compile_all(arch: int = 90, quick: bool = False, progress=None) -> list[tuple[str, str | None]]:
    """[(label, error or None)] for every variant (or the QUICK subset), compiled for CUDA sm_<arch>."""
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


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    argv = [a for a in argv if a != "--quick"]
    arch = int(argv[0]) if argv else 90
    results = compile_all(arch, quick, progress=lambda label, err: print(f"{'ok  ' if err is None else 'FAIL'} {label}"
                                                                   + (f": {err}" if err else ""), flush=True))
    failed = sum(err is not None for _, err in results)
    print(f"{len(results) - failed}/{len(results)} kernel variants compiled for sm_{arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
