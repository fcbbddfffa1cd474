"""When requests are sent: the arrival process and the load of one benchmark.

Arrivals as vLLM's benchmark draws them: under --request-rate R the gaps are gamma-distributed with
shape b = --burstiness and scale 1/(R·b) (b = 1: exponential, a Poisson process; b < 1 burstier,
b > 1 steadier; b = inf: constant gaps 1/R). With a known number of requests the cumulative send
times are then rescaled so the last one falls at N/R (vLLM does this so the realized rate does not
drift by the 1-2% a finite sample of gaps would give); `Schedule.gaps` keeps the draws before the
rescaling. Without a rate (inf) every request is due at once. --max-concurrency caps the requests
in flight on top of the schedule: a due request waits for a free slot (its wait is the client-side
queue time). With --duration the arrivals continue (cycling over the workload) until that many
seconds have passed since the start.

A sweep (GuideLLM's): synchronous (one request at a time), then throughput (all at once, or
--max-concurrency), then constant rates interpolated between the two measured request rates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np

from llmopt import defaults
from llmopt.errors import UserInputError

INF = float("inf")


@dataclass
class Load:
    request_rate: float = INF
    burstiness: float = defaults.BENCH_BURSTINESS
    max_concurrency: int | None = None
    duration: float | None = None          # seconds of sending (None: one pass over --num-prompts)
    seed: int = defaults.BENCH_SEED
    strategy: str = "single"               # single | synchronous | throughput | constant

    def __post_init__(self) -> None:
        if not (self.request_rate > 0):
            raise UserInputError(f"--request-rate {self.request_rate}: use a rate > 0 (inf: all at once)")
        if not (self.burstiness > 0):
            raise UserInputError(f"--burstiness {self.burstiness}: use a value > 0 (1: Poisson)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise UserInputError("--max-concurrency must be at least 1")
        if self.duration is not None:
            if not (0 < self.duration < INF):
                raise UserInputError(f"--duration {self.duration}: use a number of seconds > 0")
            if self.request_rate == INF and self.max_concurrency is None:
                raise UserInputError("--duration without --request-rate sends without end: give --max-concurrency "
                                     "or --request-rate too")

    @property
    def label(self) -> str:
        if self.strategy == "constant":
            return f"constant@{self.request_rate:.3g}"
        return self.strategy


@dataclass
class Schedule:
    gaps: np.ndarray        # the drawn gaps (seconds), before any rescaling
    offsets: np.ndarray     # send time of each request from the start (seconds), rescaled as vLLM


def draw_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    if rate == INF:
        return np.zeros(n)
    if burstiness == INF:
        return np.full(n, 1.0 / rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def plan(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> Schedule:
    """The send times of n requests (see the module doc)."""
    gaps = draw_gaps(n, rate, burstiness, np.random.default_rng(seed))
    offsets = np.cumsum(gaps)
    if n and offsets[-1] > 0 and rate != INF:
        offsets = offsets * ((n / rate) / offsets[-1])
    return Schedule(gaps, offsets)


def arrivals(load: Load, num_prompts: int) -> Iterator[float]:
    """Send times (seconds from the start), in order: one pass of `num_prompts`, or until --duration."""
    if load.duration is None:
        yield from plan(num_prompts, load.request_rate, load.burstiness, load.seed).offsets.tolist()
        return
    rng = np.random.default_rng(load.seed)
    t = 0.0
    while True:
        for gap in draw_gaps(256, load.request_rate, load.burstiness, rng).tolist():
            t += gap
            if t >= load.duration:
                return
            yield t


def sweep_loads(base: Load, sync_rate: float, throughput_rate: float, size: int) -> list[Load]:
    """The constant-rate benchmarks of a sweep after the synchronous and throughput ones: size − 2
    rates evenly spaced above the synchronous rate up to the throughput rate (GuideLLM)."""
    if size < 3 or not (sync_rate > 0 and throughput_rate > 0):
        return []
    rates = np.linspace(sync_rate, throughput_rate, size - 1)[1:]
    return [replace(base, request_rate=float(r), burstiness=INF, strategy="constant") for r in rates]


def synchronous(base: Load) -> Load:
    return replace(base, request_rate=INF, max_concurrency=1, strategy="synchronous")


def throughput(base: Load) -> Load:
    return replace(base, request_rate=INF, strategy="throughput")
