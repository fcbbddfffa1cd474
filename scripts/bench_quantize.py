"""Quality table for `llmopt quantize` on SmolLM2-135M, with llm-compressor's GPTQ measured in the
same run: perplexity and KLD against the base model on WikiText-2 test (eval-ppl's `chunks` method,
2,048-token windows, the first --limit-tokens tokens), checkpoint size and quantization time.

Every checkpoint is written in its method's default format (GPTQ v1, AutoAWQ GEMM,
compressed-tensors, bitsandbytes for NF4) and scored by `llmopt.eval` exactly as `llmopt eval-ppl
--base-model` scores it: the packed weights go through llmopt's quantized modules, W8A8 rows
quantize activations per token.
Calibration: the defaults (128 windows of 512 tokens of ../shared/data/wikitext-2/wiki.valid.tokens,
seed 0). With --peer, llm-compressor (scripts/peer_venv.sh builds its own venv, .venv-llmc) runs
GPTQ W4 g64 sym on the very same calibration windows (written to a file it reads) right after ours,
and its compressed-tensors checkpoint is scored by the same code.

    python scripts/bench_quantize.py --peer --out docs/bench-quantize.json     # ~1 hour on 2 cores
    python scripts/bench_quantize.py --only RTN,GPTQ --limit-tokens 8192        # a quick subset
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchlib import hf_folder
from llmopt import defaults
from llmopt.eval.data import load_text_dataset
from llmopt.eval.ppl import plan_ppl, run_ppl
from llmopt.models.loader import load_model, load_tokenizer, safetensors_files
from llmopt.quant.calib import load_calibration
from llmopt.quant.pipeline import quantize_model
from llmopt.quant.config import QuantConfig

REPO = Path(__file__).resolve().parents[1]
PEER_PY = REPO / ".venv-llmc" / "bin" / "python"
PEER = "llm-compressor GPTQ w4 g%d sym"


def rows(args):
    g = args.group_size
    common = dict(calib_data=args.calib_data, num_samples=args.num_samples, seq_len=args.seq_len, seed=0)
    return [
        ("RTN w4 g%d sym" % g, QuantConfig(method="rtn", bits=4, group_size=g, sym=True, **common)),
        ("GPTQ w4 g%d sym" % g, QuantConfig(method="gptq", bits=4, group_size=g, sym=True, **common)),
        (PEER % g, None),
        ("AWQ w4 g%d asym" % g, QuantConfig(method="awq", bits=4, group_size=g, sym=False, **common)),
        ("FP8 W8A8 (per-channel, dynamic)", QuantConfig(method="fp8", **common)),
        ("INT8 W8A8 SmoothQuant 0.5", QuantConfig(method="int8", **common)),
        ("NVFP4A16 (E2M1, E4M3 scale a 16, global scale)", QuantConfig(method="nvfp4", **common)),
        ("NVFP4A16 GPTQ (--fp4-algorithm gptq)", QuantConfig(method="nvfp4", fp4_algorithm="gptq", **common)),
        ("MXFP4A16 (E2M1, E8M0 scale a 32)", QuantConfig(method="mxfp4", **common)),
        ("MXFP4A16 GPTQ (--fp4-algorithm gptq)", QuantConfig(method="mxfp4", fp4_algorithm="gptq", **common)),
        ("NVFP4 W4A4 (FP4 activations, --activations dynamic)",
         QuantConfig(method="nvfp4", activations="dynamic", **common)),
        ("MXFP4 W4A4 (FP4 activations, --activations dynamic)",
         QuantConfig(method="mxfp4", activations="dynamic", **common)),
        ("NF4 (bitsandbytes, blocks of 64, double quantized)", QuantConfig(method="nf4", **common)),
    ]


def run_peer(args, out: Path) -> tuple[float, dict]:
    """llm-compressor on our calibration windows, in its own venv; returns (seconds, its report)."""
    if not PEER_PY.exists():
        sys.exit(f"{PEER_PY} is missing: run scripts/peer_venv.sh first")
    folder = hf_folder(None, args.workdir)          # llm-compressor reads a float folder (the GGUF's copy)
    ids = load_calibration(args.calib_data, load_tokenizer(folder), args.num_samples, args.seq_len, 0).ids
    ids_file = Path(args.workdir) / "calib-ids.pt"
    ids_file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ids, ids_file)
    cmd = [str(PEER_PY), str(REPO / "scripts" / "peer_llmcompressor.py"), "--model", str(folder),
           "--calib-ids", str(ids_file), "--group-size", str(args.group_size), "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    if proc.returncode:
        sys.exit(f"llm-compressor failed:\n{proc.stderr[-3000:]}")
    line = proc.stdout.strip().splitlines()[-1]
    print(line, file=sys.stderr, flush=True)
    report = json.loads(line)
    return float(report["seconds"]), report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit-tokens", type=int, default=defaults.QUANT_EVAL_LIMIT)
    ap.add_argument("--ctx", type=int, default=defaults.PPL_CTX)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--calib-data", default=str(REPO / defaults.CALIB_DATA))
    ap.add_argument("--num-samples", type=int, default=defaults.QUANT_NUM_SAMPLES)
    ap.add_argument("--seq-len", type=int, default=defaults.QUANT_SEQ_LEN)
    ap.add_argument("--workdir", default="/tmp/bench-quantize")
    ap.add_argument("--peer", action="store_true", help="also run llm-compressor's GPTQ (needs .venv-llmc)")
    ap.add_argument("--out", default=None, help="save the rows as JSON (rewritten after each row)")
    ap.add_argument("--only", default=None, help="comma-separated row prefixes to run (e.g. RTN,GPTQ)")
    args = ap.parse_args()
    torch.manual_seed(0)
    work = Path(args.workdir)
    done = []                            # quantize everything first: timings not disturbed by scoring
    for name, qconfig in rows(args):
        if args.only and not any(name.startswith(p) for p in args.only.split(",")):
            continue
        if qconfig is None and not args.peer:
            continue
        out = work / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        t0 = time.perf_counter()
        if qconfig is None:
            secs, info = run_peer(args, out)
        else:
            quantize_model(None, out, qconfig, overwrite=True)
            secs, info = time.perf_counter() - t0, {}
        done.append(dict(name=name, path=str(out), seconds=secs, load_avg=os.getloadavg()[0], peer=info))
        if args.out:   # the quantize records as soon as they exist
            Path(args.out).write_text(json.dumps(dict(args=vars(args), quantized=done), indent=2))
        print(f"{name}: quantized in {secs:.0f} s (load {done[-1]['load_avg']:.1f})", file=sys.stderr, flush=True)
    base = load_model(None, dtype="float32", device="cpu")
    plan = plan_ppl(base.tokenizer, base.config.max_position_embeddings, load_text_dataset(None), "chunks",
                    ctx=args.ctx, limit=args.limit_tokens)
    results = [dict(name="base (fp32 weights of the Q4_1 GGUF)", seconds=0.0,
                    size=sum(f.stat().st_size for f in safetensors_files(hf_folder(None, args.workdir))) / 2)]  # as fp16
    for r in done:
        q = load_model(r["path"], dtype="float32", device="cpu", tokenizer=False)
        q.tokenizer = base.tokenizer
        res = run_ppl(q, plan, base=base)
        if len(results) == 1:
            results[0].update(ppl=res.kl.base_ppl, kld=0.0, tokens=res.scored_tokens)
        results.append(dict(r, size=sum(f.stat().st_size for f in safetensors_files(Path(r["path"]))),
                            ppl=res.ppl, kld=res.kl.kld_mean, top1=res.kl.top1_agreement, tokens=res.scored_tokens))
        print(results[-1], file=sys.stderr, flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(dict(args=vars(args), rows=results), indent=2))
        del q
    print(table(results))
    ours = next((r for r in results if r["name"].startswith("GPTQ w4")), None)
    peer = next((r for r in results if r["name"].startswith("llm-compressor")), None)
    if ours and peer:
        print(f"\nGPTQ: llmopt {ours['seconds']:.0f} s, llm-compressor {peer['seconds']:.0f} s: "
              f"{peer['seconds'] / ours['seconds']:.2f}x faster; perplexity {ours['ppl']:.3f} vs {peer['ppl']:.3f}")


def table(results) -> str:
    lines = ["| model | perplexity | KLD vs base | top-1 agreement | size (MB) | quantize time (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        top1 = f"{r['top1']:.3f}" if "top1" in r else "-"
        lines.append(f"| {r['name']} | {r['ppl']:.3f} | {r['kld']:.4f} | {top1} | {r['size'] / 1e6:.1f} | "
                     f"{r['seconds']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
