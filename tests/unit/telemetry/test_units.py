"""How numbers are written for people (:mod:`nbdist.telemetry.units`): rates, sizes,
durations, rank lists, and a column brought to one unit."""

from __future__ import annotations

import pytest

from nbdist.telemetry.units import (
    fmt_bytes,
    fmt_bytes_rate,
    fmt_fraction,
    fmt_ranks,
    fmt_rate,
    fmt_seconds,
    one_unit,
)


def test_formatting():
    assert fmt_rate(None) == "-" and fmt_rate(12.34, "it/s") == "12.3 it/s"
    assert fmt_rate(96199.6, "steps/s") == "96.2k steps/s"
    assert fmt_bytes_rate(2.5e9) == "2.5 GB/s" and fmt_bytes_rate(12) == "12 B/s"
    assert fmt_seconds(0.0123) == "12.3 ms" and fmt_seconds(5e-6) == "5 µs"
    assert fmt_seconds(3725) == "1:02:05" and fmt_seconds(125) == "2:05"


@pytest.mark.parametrize("seconds, text", [
    (0, "0 ms"), (None, "-"), (999e-6, "999 µs"), (1e-3, "1 ms"), (0.9994, "999 ms"),
    (1.0, "1 s"), (119.4, "119 s"), (120, "2:00"), (3599, "59:59"), (3600, "1:00:00"),
])
def test_a_duration_changes_unit_at_a_millisecond_a_second_and_two_minutes(seconds, text):
    assert fmt_seconds(seconds) == text


def test_sizes_and_rates_take_the_largest_decimal_unit_that_fits():
    assert [fmt_bytes(x) for x in (None, 999, 1000, 12_345_678, 3e9)] == [
        "-", "999 B", "1 kB", "12.3 MB", "3 GB"]
    assert fmt_bytes(-2.5e6) == "-2.5 MB"  # a size that shrank keeps its sign and unit
    assert fmt_rate(-2500, "x") == "-2.5k x" and fmt_rate(3, "") == "3"
    assert fmt_bytes_rate(999.4) == "999 B/s" and fmt_bytes_rate(1.5e6) == "1.5 MB/s"


def test_a_share_is_a_whole_percentage():
    assert [fmt_fraction(x) for x in (None, 0.0, 0.374, 0.375, 1.0)] == [
        "-", "0%", "37%", "38%", "100%"]


def test_a_column_has_one_unit():
    assert one_unit(["68.2 ms", "850 µs", "-", "Σ 1 s"]) == ["68.2 ms", "0.85 ms", "-", "Σ 1 s"]
    assert one_unit(["19 kB", "370 MB", "0 B"]) == ["0.02 MB", "370 MB", "0 MB"]
    assert one_unit(["25.1 MB/s", "900 kB/s"]) == ["25.1 MB/s", "0.9 MB/s"]
    # never wider than the largest: two decimals at most, never 1e-09
    assert one_unit(["589 ms", "317 µs", "2.96 ms"]) == ["589 ms", "0.32 ms", "2.96 ms"]
    assert one_unit(["1 B", "3 GB"]) == ["<0.01 GB", "3 GB"]
    # units of different kinds, counts and rates, text: left as they are
    for cells in (["1 s", "2 MB"], ["100/100 it", "13.7 it/s"], ["done", "failed"]):
        assert one_unit(cells) == cells


def test_fmt_ranks():
    assert fmt_ranks([]) == ""
    assert fmt_ranks([3]) == "3"
    assert fmt_ranks([0, 1, 2, 4, 6, 7]) == "0-2, 4, 6-7"
    assert fmt_ranks([5, 0, 2, 1, 1]) == "0-2, 5"  # any order, repeats once
