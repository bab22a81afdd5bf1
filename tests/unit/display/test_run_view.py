"""The view of one run under its cell (:class:`nbdist.display.run_view.RunView`): output as
it arrives, a dashboard redrawn when due or forced, at most a share of the kernel's time."""

from __future__ import annotations

import io

import pytest
from synthetic import T0

from nbdist.display.run_view import RunView
from nbdist.display.text import StreamView
from nbdist.telemetry import events as ev
from nbdist.telemetry.recovery import Lost
from nbdist.telemetry.run import Run


class _Dashboard:
    interval = 0.25

    def __init__(self):
        self.drawn = []
        self.closed = None

    def update(self, snap):
        self.drawn.append(snap)

    def close(self, snap):
        self.closed = snap


def test_a_costly_redraw_makes_the_next_one_wait_longer(monkeypatch):
    cpu = iter([0.0, 0.06])  # the redraw took 60 ms of the kernel's CPU
    monkeypatch.setattr("nbdist.display.run_view.time.thread_time", lambda: next(cpu))
    view = RunView(StreamView("quiet"), _Dashboard())
    view.refresh(lambda: None)
    assert view.last_cost == pytest.approx(0.06)
    assert view._throttle.interval == pytest.approx(0.06 / RunView.MAX_BUSY_SHARE)


def test_a_large_runs_dashboard_redraws_no_more_often_than_its_ranks_report(monkeypatch):
    """A rank of 1,024 sends its news every 4 s: redrawing more often shows nothing new of
    most ranks, at a snapshot of every rank each time."""
    from nbdist.telemetry.events import flush_interval

    dash = _Dashboard()
    dash.interval = 0.5
    assert RunView(StreamView("quiet"), dash, world_size=2).interval == 0.5
    big = RunView(StreamView("quiet"), dash, world_size=1024)
    assert big.interval == flush_interval(1024) == 4.0
    cpu = iter([0.0, 0.001])  # a cheap redraw: the ranks' interval still holds
    monkeypatch.setattr("nbdist.display.run_view.time.thread_time", lambda: next(cpu))
    big.refresh(lambda: None)
    assert big._throttle.interval == 4.0


def test_a_snapshot_is_taken_only_when_a_redraw_is_due_or_forced():
    dash = _Dashboard()
    dash.interval = 3600.0  # the next redraw is due in an hour: only a forced one comes
    view = RunView(StreamView("quiet"), dash)
    taken = []

    def snapshot():
        taken.append(len(taken))
        return f"snap {len(taken)}"

    view.refresh(snapshot)  # the first is due
    view.refresh(snapshot)  # not due
    view.refresh(snapshot, force=True)  # news that cannot wait
    assert taken == [0, 1] and dash.drawn == ["snap 1", "snap 2"]
    view.close("final")
    assert dash.closed == "final"


def test_output_goes_through_and_without_a_dashboard_only_forced_notes_print(capsys):
    out = io.StringIO()
    view = RunView(StreamView("all", stdout=out))
    view.output([{"rank": 1, "seq": 1, "events": [ev.stream("stdout", "hello\n")]}])
    assert out.getvalue() == "[1] hello\n"
    run = Run("cell", [0, 1], world_size=2)
    run.note_recovery(Lost(T0, 1, "h", 7, "SIGKILL"))
    snap = run.snapshot()
    view.refresh(run.snapshot)  # not forced: nothing to say yet
    assert capsys.readouterr().out == ""
    view.refresh(run.snapshot, force=True)
    view.close(snap)  # the same notes are not printed twice
    printed = capsys.readouterr().out.splitlines()
    assert printed == list(snap.notes) and len(printed) == 1
    assert printed[0].endswith("rank 1 on h (pid 7) died: SIGKILL")
