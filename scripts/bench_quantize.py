"""Quality table for `llmopt quantize` on SmolLM2-135M: perplexity and KLD against the base model on
WikiText-2 test (non-overlapping chunks of --ctx tokens, the first --limit-tokens tokens), packed
size and quantization time, for base, RTN, GPTQ, AWQ (w4, --group-size), FP8 and INT8 W8A8.

Each method's checkpoint is written with `--format dequantized` (its quantized weights stored as
float16), so every row is scored by the same float model code; W8A8 rows round the activations per
token as the runtime kernels do (a forward pre-hook on every quantized Linear). Sizes are those of
the packed formats (4-bit codes + fp16 scales and zero points; 8-bit codes + fp32 scales), computed
from the layer shapes, plus the fp16 embeddings and norms.

    python scripts/bench_quantize.py --limit-tokens 8192 --num-samples 16 --out /tmp/bench-quantize.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from llmopt import defaults
from llmopt.models.attention import DenseCausalAttention
from llmopt.models.loader import load_model, resolve_checkpoint
from llmopt.quant.fp8 import fake_quantize_tokens_fp8
from llmopt.quant.int8 import fake_quantize_tokens_int8
from llmopt.quant.layerwise import LINEARS
from llmopt.quant.pipeline import quantize_model
from llmopt.quant.spec import QuantSpec

REPO = Path(__file__).resolve().parents[1]


def rows(args):
    g = args.group_size
    common = dict(calib_data=args.calib_data, num_samples=args.num_samples, seq_len=args.seq_len, seed=0,
                  format="dequantized")
    return [
        ("RTN w4 g%d sym" % g, QuantSpec(method="rtn", bits=4, group_size=g, sym=True, **common)),
        ("GPTQ w4 g%d sym" % g, QuantSpec(method="gptq", bits=4, group_size=g, sym=True, **common)),
        ("GPTQ-act-order w4 g%d sym" % g, QuantSpec(method="gptq", bits=4, group_size=g, sym=True, act_order=True,
                                                    **common)),
        ("AWQ w4 g%d asym" % g, QuantSpec(method="awq", bits=4, group_size=g, sym=False,
                                          awq_search_tokens=args.awq_search_tokens, **common)),
        ("FP8 W8A8 (per-channel, dynamic)", QuantSpec(method="fp8", **common)),
        ("INT8 W8A8 SmoothQuant 0.5", QuantSpec(method="int8", **common)),
    ]


def packed_bytes(cfg, spec: QuantSpec | None) -> int:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = [(cfg.num_attention_heads * d, h), (cfg.num_key_value_heads * d, h), (cfg.num_key_value_heads * d, h),
              (h, cfg.num_attention_heads * d), (i, h), (i, h), (h, i)]
    dense = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + (2 * cfg.num_hidden_layers + 1) * h
    n_lin = sum(o * k for o, k in shapes) * cfg.num_hidden_layers
    if spec is None:
        return 2 * (dense + n_lin)                              # the fp16 model
    if spec.method in ("fp8", "int8"):
        per_layer = sum(o * k + 4 * o for o, k in shapes)      # 8-bit codes + fp32 per-channel scales
    else:
        per_layer = sum(o * k * spec.bits // 8 + (o * k // spec.group_size) * (2 + spec.bits / 8) for o, k in shapes)
    return int(2 * dense + per_layer * cfg.num_hidden_layers)


def eval_tokens(tokenizer, limit: int) -> torch.Tensor:
    text = (REPO / defaults.PPL_DATASET).read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    return ids[:limit]


def activation_hooks(model, method: str | None):
    if method not in ("fp8", "int8"):
        return []
    fq = fake_quantize_tokens_fp8 if method == "fp8" else fake_quantize_tokens_int8
    return [layer.get_submodule(n).register_forward_pre_hook(lambda _m, a: (fq(a[0]),))
            for layer in model.model.layers for n in LINEARS]


@torch.no_grad()
def logprobs(model, chunk: torch.Tensor) -> torch.Tensor:
    hidden = model(chunk[None], torch.arange(chunk.numel()), DenseCausalAttention())[0]
    return F.log_softmax(model.compute_logits(hidden[:-1]).float(), dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit-tokens", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=defaults.PPL_CTX)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--calib-data", default=str(REPO / defaults.CALIB_DATA))
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=defaults.QUANT_SEQ_LEN)
    ap.add_argument("--awq-search-tokens", type=int, default=1024)
    ap.add_argument("--workdir", default="/tmp/bench-quantize")
    ap.add_argument("--out", default=None, help="save the rows as JSON")
    ap.add_argument("--only", default=None, help="comma-separated row prefixes to run (e.g. RTN,GPTQ)")
    args = ap.parse_args()
    torch.manual_seed(0)
    quantized = []                       # quantize everything first (timings not disturbed by scoring)
    for name, spec in rows(args):
        if args.only and not any(name.startswith(p) for p in args.only.split(",")):
            continue
        t0 = time.perf_counter()
        res = quantize_model(None, Path(args.workdir) / name.split()[0].lower(), spec, overwrite=True)
        quantized.append((name, spec, res, time.perf_counter() - t0))
        print(f"{name}: quantized in {quantized[-1][3]:.0f} s", file=sys.stderr, flush=True)
    base = load_model(None, dtype="float32", device="cpu")
    cfg = base.config
    tokens = eval_tokens(base.tokenizer, args.limit_tokens)
    chunks = [tokens[s:s + args.ctx] for s in range(0, tokens.numel() - args.ctx + 1, args.ctx)]
    print(f"base {resolve_checkpoint(None)}; {len(chunks)} chunks of {args.ctx} tokens", file=sys.stderr, flush=True)
    base_lp = [logprobs(base.model, c) for c in chunks]           # kept for KLD: [ctx-1, vocab] each
    results = [dict(name="base (fp32 weights of the Q4_1 GGUF)", seconds=0.0, size=packed_bytes(cfg, None),
                    **score(base.model, chunks, base_lp))]
    print(results[-1], file=sys.stderr, flush=True)
    for name, spec, res, secs in quantized:
        q = load_model(res.output, dtype="float32", device="cpu", tokenizer=False).model
        hooks = activation_hooks(q, spec.method if spec.activations == "dynamic" else None)
        results.append(dict(name=name, seconds=secs, size=packed_bytes(cfg, spec.resolved()),
                            mean_layer_error=res.mean_rel_error, **score(q, chunks, base_lp)))
        for h in hooks:
            h.remove()
        print(results[-1], file=sys.stderr, flush=True)
        del q
    print(table(results, args))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args=vars(args), rows=results), indent=2))


def score(model, chunks, base_lp) -> dict:
    nll, kld, n = 0.0, 0.0, 0
    for c, blp in zip(chunks, base_lp):
        lp = logprobs(model, c)
        nll -= float(lp.gather(-1, c[1:, None]).sum())
        kld += float((blp.exp() * (blp - lp)).sum())
        n += c.numel() - 1
    return dict(ppl=math.exp(nll / n), kld=kld / n, tokens=n)


def table(results, args) -> str:
    lines = ["| model | perplexity | KLD vs base | size (MB) | quantize time (s) | mean layer error |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        err = f"{r['mean_layer_error']:.4f}" if "mean_layer_error" in r else "-"
        lines.append(f"| {r['name']} | {r['ppl']:.3f} | {r['kld']:.4f} | {r['size'] / 1e6:.1f} | "
                     f"{r['seconds']:.0f} | {err} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
