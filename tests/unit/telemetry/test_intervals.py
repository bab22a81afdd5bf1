"""Interval arithmetic on ``(start, end)`` seconds (:mod:`nbdist.telemetry.intervals`): what
the worker's step accounting and the notebook's fold both count on."""

from __future__ import annotations

import random

import pytest

from nbdist.telemetry.intervals import (
    bandwidth,
    bubble_fraction,
    exposed_seconds,
    merge,
    rate,
    union_seconds,
)


def approx(x):
    """Equal to worker timestamps' precision (about 0.2 µs at today's epoch seconds)."""
    return pytest.approx(x, rel=1e-4, abs=1e-6)


def test_merge_gives_sorted_disjoint_intervals_without_empty_ones():
    assert merge([(5, 6), (0, 2), (1, 3), (4, 4), (7, 6)]) == [(0, 3), (5, 6)]
    assert merge([(0, 1), (1, 2)]) == [(0, 2)]  # touching intervals are one
    assert merge([(0, 10), (2, 3)]) == [(0, 10)]  # one inside another adds nothing
    assert merge([]) == []


def test_merging_in_parts_gives_what_merging_at_once_gives():
    rng = random.Random(7)
    spans = [(a, a + rng.uniform(0, 2)) for a in (rng.uniform(0, 20) for _ in range(60))]
    whole = merge(spans)
    for cut in (1, 17, 30, 59):
        assert merge(merge(spans[:cut]) + merge(spans[cut:])) == whole
    # the covered time, counted on a 1 ms grid, is the union's length (each end of a merged
    # interval off by less than one grid step)
    covered = sum(1 for i in range(22_000) if any(a <= i / 1000 < b for a, b in spans))
    assert union_seconds(spans) == pytest.approx(covered / 1000, abs=2e-3 * len(whole))


def test_interval_union_and_exposed_part():
    assert union_seconds([(0, 1), (0.5, 2), (3, 4)]) == approx(3.0)
    assert union_seconds([(2, 1)]) == 0.0
    # compute ends at 1.5: of comm over [1,2] and [1.8,2.5], 1.0 s is past compute
    assert exposed_seconds(1.5, [(1, 2), (1.8, 2.5)]) == approx(1.0)
    assert exposed_seconds(5.0, [(1, 2)]) == 0.0  # comm fully hidden


def test_bandwidth_uses_time_any_collective_was_running():
    assert bandwidth(1000, [(0, 0.5), (0.25, 1.0)]) == approx(1000.0)
    assert bandwidth(0, [(0, 1)]) is None and bandwidth(10, []) is None


def test_rate_from_first_and_last_point():
    assert rate([(0.0, 0), (1.0, 5), (2.0, 20)]) == approx(10.0)
    assert rate([(1.0, 3)]) is None and rate([(1.0, 1), (1.0, 2)]) is None


def test_the_bubble_is_the_idle_share_of_a_step_between_none_and_all():
    assert bubble_fraction(2.0, 1.5) == 0.25
    assert bubble_fraction(1.0, 1.2) == 0.0  # stages overlapping past the span: no bubble
    assert bubble_fraction(1.0, -1.0) == 1.0 and bubble_fraction(0.0, 1.0) == 0.0
