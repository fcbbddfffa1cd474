"""Benchmark: `llmopt eval-ppl` against the plain Hugging Face loop, same model, data, window and
stride, in one run. Prints both perplexities and the time ratio (scoring time only: model loading
and tokenization are excluded on both sides).

  python scripts/bench_eval_ppl.py                       # sliding, 2048 / 512, first 16384 tokens
  python scripts/bench_eval_ppl.py --method chunks --ctx 2048 --limit 40000

`sliding` runs the loop of the HF guide "Perplexity of fixed-length models" (transformers model,
`model(input_ids, labels=target_ids)`); `chunks` runs GPTQ's evaluation loop. The HF side loads the
same weights with transformers (`AutoModelForCausalLM.from_pretrained` on the checkpoint folder
llmopt resolved, e.g. the converted default GGUF).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time

import torch

from benchlib import hf_folder
from llmopt import defaults
from llmopt.eval import load_text_dataset, plan_ppl, run_ppl
from llmopt.models.loader import load_model


@torch.no_grad()
def hf_sliding(model, enc, max_length, stride):
    """The guide's loop verbatim; also accumulates with the exact scored-label count (the guide's
    `num_valid_tokens - batch_size` is one short for every window after the first)."""
    seq_len = enc.size(1)
    nll_sum, n_tokens, exact_sum, exact_n, prev_end_loc = 0.0, 0, 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = enc[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        neg_log_likelihood = model(input_ids, labels=target_ids).loss
        num_valid_tokens = (target_ids != -100).sum().item()
        num_loss_tokens = num_valid_tokens - target_ids.size(0)
        nll_sum += float(neg_log_likelihood) * num_loss_tokens
        n_tokens += num_loss_tokens
        exact = int((target_ids[:, 1:] != -100).sum())
        exact_sum += float(neg_log_likelihood) * exact
        exact_n += exact
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return math.exp(nll_sum / n_tokens), math.exp(exact_sum / exact_n)


@torch.no_grad()
def hf_chunks(model, enc, seqlen):
    """GPTQ's evaluation loop (non-overlapping windows, tail dropped)."""
    nsamples = enc.numel() // seqlen
    nlls = []
    for i in range(nsamples):
        batch = enc[:, i * seqlen:(i + 1) * seqlen]
        logits = model(batch).logits
        loss = torch.nn.CrossEntropyLoss()(logits[:, :-1, :].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        nlls.append(loss.float() * seqlen)
    ppl = torch.exp(torch.stack(nlls).sum() / (nsamples * seqlen)).item()
    return ppl, ppl


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dataset", default=defaults.PPL_DATASET)
    ap.add_argument("--method", choices=("sliding", "chunks"), default="sliding")
    ap.add_argument("--ctx", type=int, default=defaults.PPL_CTX, help="max_length (sliding) or ctx (chunks)")
    ap.add_argument("--stride", type=int, default=defaults.PPL_STRIDE)
    ap.add_argument("--limit", type=int, default=16384, help="tokens (0: the whole text)")
    ap.add_argument("--batch-size", type=int, default=defaults.PPL_BATCH_SIZE)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--order", choices=("ours-first", "hf-first"), default="hf-first")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    lm = load_model(a.model, "float32", "cpu")
    with tempfile.TemporaryDirectory() as tmp:   # a GGUF's float copy for transformers
        hf = AutoModelForCausalLM.from_pretrained(hf_folder(a.model, tmp), dtype=torch.float32).eval()
    data = load_text_dataset(a.dataset)
    limit = a.limit or None
    plan = plan_ppl(lm.tokenizer, lm.config.max_position_embeddings, data, a.method, ctx=a.ctx,
                    max_length=a.ctx, stride=a.stride, limit=limit)
    enc = lm.tokenizer(data.text, return_tensors="pt").input_ids
    enc = enc[:, :limit] if limit else enc

    def ours():
        t = time.perf_counter()
        r = run_ppl(lm, plan, a.batch_size)
        return r, time.perf_counter() - t

    def theirs():
        t = time.perf_counter()
        p = hf_sliding(hf, enc, a.ctx, a.stride) if a.method == "sliding" else hf_chunks(hf, enc, a.ctx)
        return p, time.perf_counter() - t

    if a.order == "hf-first":
        (hf_ppl, hf_exact), t_hf = theirs()
        r, t_ours = ours()
    else:
        r, t_ours = ours()
        (hf_ppl, hf_exact), t_hf = theirs()
    same4 = f"{r.ppl:.4g}" == f"{hf_exact:.4g}"
    print(f"eval-ppl bench: {a.method}, window {a.ctx}" + (f", stride {a.stride}" if a.method == "sliding" else "")
          + f", {enc.size(1)} tokens, batch {a.batch_size}, {torch.get_num_threads()} threads")
    print(f"  llmopt eval-ppl : ppl {r.ppl:.6f}  ({r.scored_tokens} scored tokens)  {t_ours:8.2f} s")
    if a.method == "sliding":
        print(f"  HF loop         : ppl {hf_exact:.6f}  (exact token count; the guide's weighting: {hf_ppl:.6f})"
              f"  {t_hf:8.2f} s")
    else:
        print(f"  GPTQ loop       : ppl {hf_exact:.6f}  {t_hf:8.2f} s")
    print(f"  same ppl to 4 significant digits: {same4};  speedup {t_hf / t_ours:.2f}x")
    return 0 if same4 else 1


if __name__ == "__main__":
    sys.exit(main())
