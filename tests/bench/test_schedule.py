"""The arrival schedule: gamma / exponential gaps by the numbers (Kolmogorov–Smirnov), vLLM's
rescaling to N/R, --duration, and the sweep's rates."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from llmopt.bench.schedule import INF, Load, arrivals, plan, sweep_loads, synchronous, throughput
from llmopt.errors import UserInputError


def test_poisson_gaps_pass_ks_for_the_exponential_of_the_rate_and_fail_for_another():
    rate = 5.0
    sched = plan(2000, rate, burstiness=1.0, seed=0)
    assert stats.kstest(sched.gaps, "expon", args=(0, 1 / rate)).pvalue > 0.01
    # the test has power: the same gaps are not exponential with a rate 10% off
    assert stats.kstest(sched.gaps, "expon", args=(0, 1 / (rate * 1.1))).pvalue < 0.01
    assert abs(sched.gaps.mean() - 1 / rate) < 0.05 / rate


def test_burstiness_is_the_gamma_shape():
    rate, b = 4.0, 0.5
    sched = plan(2000, rate, burstiness=b, seed=1)
    assert stats.kstest(sched.gaps, "gamma", args=(b, 0, 1 / (rate * b))).pvalue > 0.01
    assert stats.kstest(sched.gaps, "expon", args=(0, 1 / rate)).pvalue < 0.01   # burstier than Poisson
    assert np.allclose(plan(5, rate, INF).gaps, 1 / rate)                          # inf: constant gaps


def test_offsets_are_rescaled_to_n_over_rate_keeping_the_shape():
    sched = plan(200, 10.0, seed=3)
    assert sched.offsets[-1] == pytest.approx(200 / 10.0)
    raw = np.cumsum(sched.gaps)
    assert np.allclose(sched.offsets / sched.offsets[-1], raw / raw[-1])
    assert np.all(np.diff(sched.offsets) >= 0)
    assert np.array_equal(plan(200, 10.0, seed=3).offsets, sched.offsets)           # the seed fixes it
    assert not np.array_equal(plan(200, 10.0, seed=4).offsets, sched.offsets)
    assert np.all(plan(7, INF).offsets == 0)                                        # inf: all at once


def test_duration_sends_until_the_window_closes_without_rescaling():
    times = list(arrivals(Load(request_rate=50.0, duration=2.0, seed=0), num_prompts=5))
    assert times and max(times) < 2.0 and len(times) > 5                            # cycles past the workload
    assert 70 < len(times) < 130                                                    # ~ rate x duration
    assert list(arrivals(Load(request_rate=50.0, seed=0), 4)) == plan(4, 50.0, seed=0).offsets.tolist()


def test_sweep_rates_are_interpolated_between_synchronous_and_throughput():
    base = Load(max_concurrency=8)
    assert synchronous(base).max_concurrency == 1 and synchronous(base).request_rate == INF
    assert throughput(base).max_concurrency == 8 and throughput(base).strategy == "throughput"
    loads = sweep_loads(base, 1.0, 5.0, size=6)
    assert [x.request_rate for x in loads] == pytest.approx([2.0, 3.0, 4.0, 5.0])
    assert all(x.strategy == "constant" and x.burstiness == INF for x in loads)
    assert loads[0].label == "constant@2"


@pytest.mark.parametrize("kw, fragment", [
    (dict(request_rate=0), "--request-rate"), (dict(burstiness=-1), "--burstiness"),
    (dict(max_concurrency=0), "--max-concurrency"), (dict(duration=5.0), "without end"),
])
def test_bad_loads_are_refused(kw, fragment):
    with pytest.raises(UserInputError, match=fragment):
        Load(**kw)
