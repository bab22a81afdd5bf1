"""When a run counts as stalled (:mod:`nbdist.telemetry.stall.thresholds`): the rules the
workers and the notebook share."""

from __future__ import annotations

from nbdist.telemetry.stall.thresholds import (
    QUIET_FLOOR_S,
    STALL_FLOOR_S,
    probe_after,
    quiet_after,
    stall_threshold,
)


def test_threshold_is_five_median_steps_at_least_the_floor_or_the_users():
    assert stall_threshold([]) == STALL_FLOOR_S == 10.0
    assert stall_threshold([0.1] * 30) == 10.0
    assert stall_threshold([4.0, 4.0, 100.0]) == 20.0  # the median: one slow step is not it
    assert stall_threshold([4.0], override=2.5) == 2.5
    assert stall_threshold([4.0], override=0) is None  # --stall-after 0: off
    assert stall_threshold(iter([3.0, 3.0])) == 15.0  # any iterable of step times


def test_the_dashboard_says_quiet_long_before_the_verdict():
    assert quiet_after([]) == QUIET_FLOOR_S == 2.0
    assert quiet_after([0.1, 0.2]) == 2.0 and quiet_after([2.0, 2.0, 9.0]) == 6.0
    for steps in ([], [0.1], [1.0, 1.0], [4.0], [30.0]):
        assert quiet_after(steps) < stall_threshold(steps)


def test_a_worker_reports_where_it_is_before_the_notebooks_threshold_passes():
    for threshold in (0.4, 2.5, 10.0, 60.0):  # half-way there at the latest
        assert probe_after(threshold) <= threshold / 2
    assert probe_after(10.0) == 5.0
    assert probe_after(0.1) == 0.2  # but never sooner than 0.2 s after the last progress
