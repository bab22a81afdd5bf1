"""What a run keeps of its events for a trace file (:mod:`nbdist.telemetry.recorded`): each
rank's events as they came, tables' rows included, at most ``MAX_RECORDED``, the oldest dropped
first; let go on demand; only counted for a run that writes no trace."""

from __future__ import annotations

from nbdist.telemetry import events as ev
from nbdist.telemetry import recorded
from nbdist.telemetry.columns import table
from nbdist.telemetry.recorded import Recorded

T0 = 1_700_000_000.0


def test_events_come_back_per_rank_in_order_tables_expanded():
    rec = Recorded()
    steps = [ev.step(n, T0 + n, T0 + n + 0.5) for n in range(3)]
    rec.add(0, ev.scalars({"loss": 1.0}, T0), 1)
    rec.add(0, table(steps), 3)
    rec.add(1, ev.scalars({"loss": 2.0}, T0), 1)
    assert rec.events() == {0: [ev.scalars({"loss": 1.0}, T0), *steps],
                            1: [ev.scalars({"loss": 2.0}, T0)]}
    assert (rec.held, rec.dropped, rec.untraced) == (5, 0, 0)


def test_past_the_cap_the_oldest_go_first_and_are_counted(monkeypatch):
    monkeypatch.setattr(recorded, "MAX_RECORDED", 4)
    rec = Recorded()
    for n in range(6):
        rec.add(0, ev.scalars({"x": float(n)}, T0 + n), 1)
    assert [e["values"]["x"] for e in rec.events()[0]] == [2.0, 3.0, 4.0, 5.0]
    assert (rec.held, rec.dropped) == (4, 2)
    rec.clear()  # let go: nothing held, and what comes next is kept up to the cap again
    assert (rec.events(), rec.held) == ({}, 0)
    rec.add(0, ev.scalars({"x": 9.0}, T0), 1)
    assert [e["values"]["x"] for e in rec.events()[0]] == [9.0]


def test_without_a_trace_events_are_only_counted():
    rec = Recorded(trace=False)
    rec.add(0, table([ev.step(n, T0 + n, T0 + n + 0.5) for n in range(3)]), 3)
    rec.add(1, ev.scalars({"loss": 1.0}, T0), 1)
    assert (rec.events(), rec.kept, rec.held, rec.untraced) == ({}, {}, 0, 4)
