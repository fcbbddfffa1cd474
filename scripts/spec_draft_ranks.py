"""How close an EAGLE / EAGLE-3 head's drafts come on Spec-Bench's questions, beyond its acceptance
length: chain drafting of K tokens at batch 1, greedy, over the first N questions of each category
(chat template, max_tokens as the benchmark's); at each depth d, among the steps whose drafts
before d were all accepted, how often the target's token there is the head's top-1 (what the
chain accepts) or within its top-k (what a draft tree of k siblings at that depth could accept).
Rates are over all verifying steps, so the top-1 column sums to the acceptance length minus 1;
the acceptance length per category comes with them.

    python scripts/spec_draft_ranks.py --spec-model out/smollm2-eagle3-self2/head --per-category 3 --k 3

Spec-Bench's questions are evaluation data: this measures, it trains nothing.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOPS = (1, 2, 3, 4, 6, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec-model", required=True, help="EAGLE head folder")
    ap.add_argument("--method", default="eagle3", choices=("eagle", "eagle3"))
    ap.add_argument("--model", default=None, help="target (default: the built-in smollm2-135m)")
    ap.add_argument("--k", type=int, default=3, help="drafts per step")
    ap.add_argument("--per-category", type=int, default=3, help="questions per Spec-Bench category")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()

    import torch
    from llmopt import defaults
    from llmopt.bench.datasets import spec_bench_requests
    from llmopt.bench.offline import chat_text
    from llmopt.engine.args import EngineArgs
    from llmopt.engine.engine import LLMEngine
    from llmopt.engine.sampling_params import SamplingParams

    eng = LLMEngine(EngineArgs(model=args.model, dtype="float32", device="cpu", max_num_seqs=1, detokenize=False,
                               max_model_len=2048, enable_prefix_caching=False,
                               speculative_config={"method": args.method, "model": args.spec_model,
                                                   "num_speculative_tokens": args.k}))
    tok = eng.tokenizer
    head = eng.drafter.proposer.head
    ranked: list[list[int]] = []          # the head's top ids per draft row, in drafting order
    pick = head.logits_to_target

    def logits_to_target(out, tgt):       # wraps the proposer's greedy pick to keep the ranking
        with torch.no_grad():
            if head.eagle3:
                ids = head.lm_head(head.norm(out)).topk(max(TOPS), -1).indices
                ids = ids + head.d2t[ids]
            else:
                ids = tgt.compute_logits(out).topk(max(TOPS), -1).indices
        ranked.extend(ids.tolist())
        return pick(out, tgt)

    head.logits_to_target = logits_to_target
    hits: collections.Counter = collections.Counter()
    cat_steps: collections.Counter = collections.Counter()      # per category: verifying steps, drafts accepted
    cat_accepted: collections.Counter = collections.Counter()
    record = eng.drafter.record

    def counting_record(sched, sampled):
        for s in sched.scheduled:
            got, drafts = sampled.get(s.request_id), s.spec_token_ids
            if not drafts or got is None:
                continue
            tops = ranked[-len(drafts):]
            cat = s.request_id.rsplit("-", 1)[0]
            cat_steps[cat] += 1
            for d, want in enumerate(got.token_ids[:len(drafts)]):
                for k in TOPS:
                    hits[d, k] += want in tops[d][:k]
                if want != drafts[d]:
                    break
                cat_accepted[cat] += 1
        ranked.clear()
        return record(sched, sampled)

    eng.drafter.record = counting_record
    reqs = spec_bench_requests(tok, Path(defaults.BENCH_SPEC_BENCH_PATH), args.max_tokens)
    by_cat: dict[str, list] = collections.defaultdict(list)
    for r in reqs:
        by_cat[r.category].append(r)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for cat in sorted(by_cat):
        for i, r in enumerate(by_cat[cat][:args.per_category]):
            eng.add_request(f"{cat}-{i}", eng.tokenize(chat_text(tok, r.prompt), add_special_tokens=False), params)
            while eng.has_unfinished_requests():
                eng.step()
    steps = sum(cat_steps.values())
    rates = {d + 1: {k: round(hits[d, k] / max(steps, 1), 4) for k in TOPS} for d in range(args.k)}
    st = eng.stats().spec_decoding
    print(json.dumps({"spec_model": args.spec_model, "k": args.k, "questions": sum(
        min(len(v), args.per_category) for v in by_cat.values()), "steps": steps,
        "acceptance_length": round(st.mean_acceptance_length, 4), "depth_topk_rates": rates,
        "acceptance_length_by_category": {c: round(1 + cat_accepted[c] / n, 4) for c, n in sorted(cat_steps.items())}}))


if __name__ == "__main__":
    main()
