"""A tuning trial's figures from its ranks' events (:mod:`nbdist.telemetry.trials`): steps
every rank reported, less the warm-up, the slowest rank's time, medians over pooled trials."""

from __future__ import annotations

import statistics

import pytest

from nbdist.telemetry import events as ev
from nbdist.telemetry.trials import TrialSteps, figures, steps_of, warmup


def step(n, length, *, samples=8, exposed=0.0, nbytes=1000, timed=True, t0=100.0):
    start = t0 + n
    return ev.step(n, start, start + length, samples=samples, comm_exposed_s=exposed,
                   comm_bytes=nbytes, comm_timed=timed)


def test_the_warm_up_is_a_fifth_of_the_steps_at_least_two():
    assert [warmup(n) for n in (2, 5, 10, 14, 15, 100)] == [2, 2, 2, 2, 3, 20]


def test_only_steps_every_rank_reported_count_after_the_warm_up():
    events = {0: [step(n, 0.1) for n in range(6)],
              1: [step(n, 0.2) for n in range(6) if n != 3]}  # rank 1's step 3 never came
    steps = steps_of(events, skip=2)
    # common steps 0, 1, 2, 4, 5; the first two skipped; each the slower rank's 0.2 s
    assert steps.step_s == pytest.approx((0.2, 0.2, 0.2))
    assert steps.samples == (16.0, 16.0, 16.0)
    assert steps_of({}, skip=0) == TrialSteps((), (), (), (), None)


def test_exposed_share_counts_only_timed_steps_and_bytes_come_from_the_lowest_rank():
    events = {2: [step(0, 0.1, exposed=0.05, nbytes=300), step(1, 0.1, timed=False)],
              5: [step(0, 0.1, exposed=0.01, nbytes=999), step(1, 0.1, timed=False)]}
    steps = steps_of(events, skip=0)
    assert steps.exposed == pytest.approx((0.3,))  # mean of 50 % and 10 %; step 1 untimed
    assert steps.nbytes == (300, 1000)


def test_the_peak_is_a_ranks_last_memory_report_gpu_first():
    mem = dict(params=1, grads=1, optimizer=1, rss=10)
    events = {0: [ev.memory(1.0, peak=50, **mem), ev.memory(2.0, peak=70, **mem)],
              1: [ev.memory(1.0, peak=900, device_peak=4000, **mem)]}
    assert steps_of(events, skip=0).peak_memory == 4000
    assert steps_of({0: events[0]}, skip=0).peak_memory == 70


def test_pooled_trials_give_medians_and_the_interquartile_range():
    a = TrialSteps((0.1, 0.3), (32.0, 32.0), (0.2,), (100, 100), 10)
    b = TrialSteps((0.2, 0.4, 0.5), (32.0, 32.0, 32.0), (), (100, 100, 300), None)
    f = figures([a, b])
    pooled = [0.1, 0.3, 0.2, 0.4, 0.5]
    q1, _, q3 = statistics.quantiles(pooled, n=4)
    assert (f.steps, f.step_s, f.spread_s) == (5, 0.3, pytest.approx(q3 - q1))
    assert f.samples_per_s == pytest.approx(32 / 0.3)
    assert (f.exposed_fraction, f.bytes_per_step, f.peak_memory) == (0.2, 100, 10)
    one = figures([TrialSteps((0.5,), (0.0,), (), (), None)])
    assert one.spread_s == 0.0 and one.samples_per_s is None and one.exposed_fraction is None
    assert figures([TrialSteps((), (), (), (), 5)]) is None
