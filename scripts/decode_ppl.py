"""Perplexity through the decode step: WikiText-2 test text fed one token per step (teacher forcing)
to the engine's runner, S sequences per step, so every logit comes from the CPU decode path being
measured. `eval-ppl` scores with prefill forwards and never runs the decode step; this script is how
docs/benchmarks.md prices the C++ decode layer's int8 activations (llmopt/engine/cpu_decode.py):

    python scripts/decode_ppl.py --model out/smollm2-135m-awq-w4g64 --seqs 4 --tokens 256

For each model it prints the perplexity of the same tokens through the Python layers, the C++ layers
with float activations and the C++ layers with int8 activations (quantized weights only), and the
share of positions where the greedy token differs from the Python layers' one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmopt import defaults  # noqa: E402


def token_rows(tokenizer, seqs: int, tokens: int) -> list[list[int]]:
    from llmopt.data import read_dataset
    data = read_dataset(defaults.PPL_DATASET, defaults.TEXT_FIELD, defaults.PPL_SPLIT)
    ids = tokenizer.encode(data.text[: seqs * tokens * 8])
    if len(ids) < seqs * tokens:
        raise SystemExit("not enough text for --seqs x --tokens")
    return [ids[i * tokens:(i + 1) * tokens] for i in range(seqs)]


def run(runner, rows: list[list[int]], mode: str) -> tuple[float, list[int]]:
    """Mean NLL of rows[s][t + 1] given rows[s][:t + 1], and the greedy tokens, with the decode path
    `mode`: python | float | int8."""
    from llmopt.engine.scheduler import ScheduledRequest, SchedulerOutput
    f = runner.cpu_decode
    if mode != "python":
        f.set_int8_activations(mode == "int8")
    runner.cpu_decode = None if mode == "python" else f
    bs, n = runner.block_size, len(rows[0])
    per = -(-n // bs)
    tables = [list(range(1 + s * per, 1 + (s + 1) * per)) for s in range(len(rows))]
    nll, greedy = 0.0, []
    try:
        for t in range(n - 1):
            step = SchedulerOutput([ScheduledRequest(f"s{s}", [rows[s][t]], t, tables[s], 1) for s in range(len(rows))])
            logits = runner.execute(step).double()
            target = torch.tensor([r[t + 1] for r in rows])
            nll -= float(torch.log_softmax(logits, -1).gather(1, target[:, None]).sum())
            greedy.extend(logits.argmax(-1).tolist())
    finally:
        runner.cpu_decode = f
    return nll / ((n - 1) * len(rows)), greedy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=None, help="checkpoint (repeatable; default the built-in)")
    ap.add_argument("--quantization", default=None, help="int8 | fp8 at load, for a float checkpoint")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    from llmopt.engine.args import EngineArgs
    from llmopt.engine.engine import LLMEngine
    for model in a.model or [None]:
        engine = LLMEngine(EngineArgs(model=model, dtype="float32", device="cpu", quantization=a.quantization,
                                      max_model_len=a.tokens + 16, enable_prefix_caching=False))
        if engine.runner.cpu_decode is None:
            raise SystemExit("the C++ decode layers do not run this model")
        rows = token_rows(engine.tokenizer, a.seqs, a.tokens)
        res = {"model": model or defaults.DEFAULT_MODEL, "quantization": a.quantization,
               "tokens": a.seqs * (a.tokens - 1)}
        ref_greedy = None
        for mode in ("python", "float", "int8"):
            nll, greedy = run(engine.runner, rows, mode)
            res[f"ppl_{mode}"] = round(math.exp(nll), 4)
            if ref_greedy is None:
                ref_greedy = greedy
            else:
                res[f"greedy_diff_{mode}"] = round(sum(x != y for x, y in zip(greedy, ref_greedy)) / len(greedy), 4)
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
