"""Logged values over many ranks, per step: min, median and max
(:class:`nbdist.telemetry.spread.ScalarSpread`)."""

from __future__ import annotations

import random
import statistics

from nbdist.telemetry.spread import ScalarSpread


def test_each_step_gives_the_min_median_and_max_of_the_ranks_values():
    s = ScalarSpread(history=10)
    for rank, v in enumerate([3.0, 1.0, 2.0, 10.0]):
        s.add(rank, "loss", 0, v)
    s.add(0, "loss", 1, 5.0)
    assert s.series() == {"loss": ((0, 1.0, 2.5, 10.0), (1, 5.0, 5.0, 5.0))}


def test_a_value_logged_again_replaces_the_ranks_last_and_the_spread_follows():
    s = ScalarSpread(history=10)
    s.add(0, "lr", 0, 1.0)
    s.add(1, "lr", 0, 3.0)
    assert s.series()["lr"] == ((0, 1.0, 2.0, 3.0),)
    s.add(1, "lr", 0, 1.0)  # the same rank, name and step: the new value counts
    assert s.series()["lr"] == ((0, 1.0, 1.0, 1.0),)


def test_only_the_last_history_steps_of_each_name_are_kept():
    s = ScalarSpread(history=3)
    for step in range(6):
        s.add(0, "loss", step, float(step))
    s.add(0, "acc", 0, 0.5)
    out = s.series()
    assert [p[0] for p in out["loss"]] == [3, 4, 5]
    assert out["acc"] == ((0, 0.5, 0.5, 0.5),)


def test_added_in_any_order_the_series_is_by_step_and_matches_statistics():
    rng = random.Random(3)
    values = {(r, x): rng.uniform(-1, 1) for r in range(7) for x in range(5)}
    s = ScalarSpread(history=10)
    for (r, x), v in sorted(values.items(), key=lambda _: rng.random()):
        s.add(r, "g", x, v)
    for x, lo, mid, hi in s.series()["g"]:
        col = [v for (r, step), v in values.items() if step == x]
        assert (lo, mid, hi) == (min(col), statistics.median(col), max(col))
    assert [p[0] for p in s.series()["g"]] == list(range(5))
