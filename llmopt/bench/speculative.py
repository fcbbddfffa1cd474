"""`llmopt bench --spec METHOD` offline: the same prompts under the same load on a plain engine
(the same loaded weights, speculation off), so one run reports the speedup next to the acceptance."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llmopt.engine.engine import LLMEngine


@dataclass
class SpecComparison:
    method: str
    num_speculative_tokens: int
    plain_output_throughput: float       # tok/s without speculation
    spec_output_throughput: float        # tok/s with it
    speedup: float | None                # spec / plain output throughput
    plain_duration: float
    spec_duration: float
    acceptance_length: float | None      # 1 + accepted / drafts
    acceptance_rate_per_pos: list[float] | None
    outputs_identical: bool | None       # greedy runs: every completion token for token the same


def compare_plain(engine, cfg, requests, load, hooks, spec_result, run_engine, result_of) -> SpecComparison:
    """Run `requests` on a plain twin of `engine` and compare with `spec_result` (a BenchResult)."""
    plain = LLMEngine(dataclasses.replace(engine.args, speculative_config=None), loaded=engine.loaded)
    run = run_engine(plain, cfg, requests, load, hooks, "bench plain (no speculation)")
    base = result_of(run)
    s, p = spec_result.summary, base.summary
    server = spec_result.server
    same = None
    if cfg.sampling.temperature == 0 and not (run.interrupted or spec_result.interrupted):
        same = [r.generated_text for r in spec_result.records] == [r.generated_text for r in base.records]
    sc = engine.args.speculative_config
    return SpecComparison(sc.method, sc.num_speculative_tokens, p.output_throughput, s.output_throughput,
                          s.output_throughput / p.output_throughput if p.output_throughput else None,
                          base.duration, spec_result.duration, server.spec_decode_acceptance_length,
                          server.spec_decode_per_position_acceptance_rates, same)
