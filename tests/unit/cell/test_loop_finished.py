"""The cell loop (:mod:`nbdist.cell.loop`) on the scripted backend when a rank finishes while
another still runs: the finished rank's row reads finished at once, and a peer left waiting in
a collective it will never complete is interrupted within seconds, with the error that says
so; a peer that still computes is left to run."""

from __future__ import annotations

import time

import pytest
from fakes import Scripted, failed, ok
from synthetic import stack_sleeping, stack_waiting

from nbdist.cell import loop as cell_run
from nbdist.display.tables import run_table
from nbdist.errors import CellTimeoutError, RanksFinishedError
from nbdist.telemetry import events as ev
from nbdist.telemetry.stall.report import STRANDED_AFTER_S


def finished(ended_ago: float) -> dict:
    """Rank 1's result: it finished ``ended_ago`` seconds ago, its end in the last batch."""
    result = ok(seq=0)
    result["tail"] = {"rank": 1, "seq": 1, "events": [ev.end(True, time.time() - ended_ago)]}
    return result


def rank_1_rows(monkeypatch) -> list[tuple[bool, str]]:
    """Rank 1's row state after each pass of the loop, with whether rank 0 still ran."""
    seen: list[tuple[bool, str]] = []
    pump = cell_run.pump

    def watching(job, run, view, *args, **kw):
        pump(job, run, view, *args, **kw)
        [row] = [r for r in run_table(run.snapshot()).rows if r.rank == 1]
        seen.append((bool(job.pending()), row.cells[-1]))

    monkeypatch.setattr(cell_run, "pump", watching)
    return seen


def test_a_peer_left_in_a_collective_ends_the_cell_within_seconds(session, backend,
                                                                  monkeypatch):
    backend.script(r0=Scripted(hang=True, batches=[{"rank": 0, "seq": 1, "events": [
                       stack_waiting(time.time() - 0.5)]}]),
                   r1=Scripted(finished(ended_ago=0.1)))
    rows = rank_1_rows(monkeypatch)
    start = time.monotonic()
    with pytest.raises(RanksFinishedError) as info:
        session.run_cell("train()", timeout=60, execution_count=4)
    took = time.monotonic() - start
    assert STRANDED_AFTER_S - 0.2 < took < STRANDED_AFTER_S + 5, took
    assert backend.interrupted == {backend.ids[0]}  # the waiting rank, not the finished one
    e = info.value
    assert (e.finished, e.ranks) == ([1], [0])
    assert str(e).startswith("cell ended: Rank 1 finished the cell while rank 0 waits in "
                             "all_reduce (seq 5, float32 [4]) at In [4], line 6: "
                             "dist.all_reduce(t): a collective of every rank"), str(e)
    # live: rank 1's row read done while rank 0 still ran
    assert (True, "done") in rows, rows


def test_the_error_says_where_the_ranks_were_when_the_interrupts_report_never_came(
        session, backend):
    """The interrupted rank's end arrives, its report of the interrupt does not (a batch can
    be late): its last report is older than its end, so the run no longer knows where it
    is; the error says where the ranks were when the notebook saw it stranded."""
    interrupted = failed("KeyboardInterrupt", "", seq=1)
    interrupted["tail"] = {"rank": 0, "seq": 2, "events": [
        ev.end(False, time.time(), error="KeyboardInterrupt")]}
    backend.script(r0=Scripted(interrupted, hang=True, batches=[{"rank": 0, "seq": 1, "events": [
                       stack_waiting(time.time() - 0.5)]}]),
                   r1=Scripted(finished(ended_ago=0.1)))
    with pytest.raises(RanksFinishedError) as info:
        session.run_cell("train()", timeout=60, execution_count=4)
    text = str(info.value)
    assert "Where each rank was when it was interrupted:" in text, text
    assert "rank 0: waiting in all_reduce (seq 5" in text, text
    assert "rank 1: finished the cell" in text, text


def test_a_peer_that_still_computes_is_left_to_run(session, backend, monkeypatch):
    backend.script(r0=Scripted(hang=True, batches=[{"rank": 0, "seq": 1, "events": [
                       stack_sleeping(time.time() - 0.5)]}]),
                   r1=Scripted(finished(ended_ago=10)))
    rows = rank_1_rows(monkeypatch)
    with pytest.raises(CellTimeoutError) as info:  # only the cell's own time limit ends it
        session.run_cell("train()", timeout=STRANDED_AFTER_S + 1)
    assert (True, "done") in rows, rows
    assert "rank 1: finished the cell" in str(info.value)
