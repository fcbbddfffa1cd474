"""Structured-output overhead: the default model's output tokens/s with and without a JSON schema, at
batch 1 and 32, in one process (plain and constrained runs alternate, so both see the same minutes of
a noisy machine), and the time the grammar work itself takes per step (llguidance filling each
row's bitmask, and the sampler applying it), against the step it rides on.

    python scripts/bench_structured.py                    # --batch 1 --batch 32 --tokens 128 --rounds 3

Both kinds of request generate exactly --tokens tokens (greedy): the plain ones ignore EOS, and the
schema (an array of at least 2 x --tokens integers) cannot close within them, so every step is a
constrained step and the token counts are equal; the script checks both. Run it on an idle machine
(`uptime`); speed is measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import llmopt
from llmopt import LLM, SamplingParams
from llmopt.core import sampler
from llmopt.structured import StructuredOutputsParams, backend


class GrammarClock:
    """Wall time inside RequestGrammar.fill and the sampler's apply_bitmask (wrapped, this process only)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        fill, apply = backend.RequestGrammar.fill, sampler.apply_bitmask

        def timed(fn):
            def run(*args, **kw):
                t = time.perf_counter()
                try:
                    return fn(*args, **kw)
                finally:
                    self.seconds += time.perf_counter() - t
            return run
        backend.RequestGrammar.fill = timed(fill)
        sampler.apply_bitmask = timed(apply)


def prompts(n: int) -> list[str]:
    topics = ["primes", "years", "prices", "distances", "scores", "ages", "heights", "counts"]
    return [f"Write a JSON array of {topics[i % len(topics)]} (list {i}):" for i in range(n)]


def run(llm: LLM, batch: int, tokens: int, schema: dict | None, requests: int) -> tuple[float, int, int]:
    """(seconds, output tokens, engine steps) of `requests` prompts, `batch` at a time."""
    so = StructuredOutputsParams(json=schema) if schema is not None else None
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=schema is None, structured_outputs=so)
    ps = prompts(requests)
    t, out = time.perf_counter(), []
    for i in range(0, requests, batch):
        out += llm.generate(ps[i:i + batch], params)
    seconds = time.perf_counter() - t
    lengths = [len(o.outputs[0].token_ids) for o in out]
    assert lengths == [tokens] * requests, f"unequal lengths: {sorted(set(lengths))}"
    if schema is not None:
        assert all(o.outputs[0].finish_reason == "length" and o.outputs[0].text.lstrip().startswith("[")
                   for o in out), "the schema closed early or was not followed"
    return seconds, sum(lengths), tokens * (requests // batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the built-in smollm2-135m)")
    ap.add_argument("--batch", type=int, action="append", default=None, help="batch sizes (default 1, 32)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--requests-at-1", type=int, default=4, help="requests run one at a time at batch 1")
    ap.add_argument("--rounds", type=int, default=3, help="plain/schema pairs per batch size (median)")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 2 * a.tokens}
    print(f"llmopt {llmopt.__file__}")
    clock = GrammarClock()
    llm = LLM(a.model or llmopt.defaults.DEFAULT_MODEL, max_model_len=512, max_num_seqs=max(a.batch or [32]))
    run(llm, 1, 8, None, 1)     # warm-up: the kernels
    run(llm, 1, 8, schema, 1)   # and the tokenizer's llguidance view
    results = []
    for batch in a.batch or [1, 32]:
        requests = a.requests_at_1 if batch == 1 else batch
        plain, constrained, grammar = [], [], []
        for _ in range(a.rounds):
            s, n, _ = run(llm, batch, a.tokens, None, requests)
            plain.append(n / s)
            before = clock.seconds
            s, n, steps = run(llm, batch, a.tokens, schema, requests)
            constrained.append(n / s)
            grammar.append((clock.seconds - before) / steps)
        p, c, g = statistics.median(plain), statistics.median(constrained), statistics.median(grammar)
        step_ms = 1e3 * batch / p
        row = {"batch": batch, "plain_tok_s": round(p, 1), "json_schema_tok_s": round(c, 1),
               "ratio": round(c / p, 3), "plain_step_ms": round(step_ms, 2), "grammar_ms_per_step": round(1e3 * g, 3),
               "grammar_share_of_step": round(1e3 * g / step_ms, 4)}
        results.append(row)
        print(f"batch {batch:>3}: plain {p:7.1f} tok/s, json schema {c:7.1f} tok/s ({c / p:.3f}x); "
              f"plain step {step_ms:.2f} ms, grammar {1e3 * g:.3f} ms a step ({100e3 * g / step_ms:.1f}% of it)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
