"""The cell loop (:mod:`nbdist.cell.loop`) on the scripted backend: a worker the engine loses
in a cell without elastic training is one death, said alike by its row, the run's header and
the raised error."""

from __future__ import annotations

import re

import pytest
from fakes import Scripted, ok

from nbdist.cell.loop import pump
from nbdist.display.html import run_header
from nbdist.display.tables import run_table
from nbdist.display.text import format_line, format_summary
from nbdist.errors import DistributedError
from nbdist.telemetry import events as ev
from nbdist.telemetry.recovery import Recovery, RecoveryKind
from nbdist.telemetry.run import Run
from nbdist.telemetry.states import RankState

T0 = 1_700_000_000.0
ENGINE_SAID = "EngineError: Engine 101 died while running task 'train'"


def steps(rank: int, n: int, *, end: bool) -> dict:
    """A batch of ``rank``'s first ``n`` steps, with its end-of-cell report or without it
    (a worker killed mid-cell sends none)."""
    events = [ev.step(i, T0 + i, T0 + i + 0.1, samples=8, comm_total_s=0.02,
                      comm_exposed_s=0.01) for i in range(n)]
    if end:
        events.append(ev.end(True, T0 + n))
    return {"rank": rank, "seq": 1, "events": events}


def row_state(snap, rank: int) -> str:
    [row] = [r for r in run_table(snap).rows if r.rank == rank]
    return row.cells[-1]


def test_a_worker_lost_mid_cell_is_one_death_in_its_row_the_header_and_the_error(
        session, backend, monkeypatch, capsys):
    dead = backend.ids[1]
    # the engine failed rank 1's call; asked how its process ended, it says SIGKILL
    monkeypatch.setattr(backend, "exit_cause",
                        lambda w, pid: "SIGKILL" if (w, pid) == (dead, dead) else None)
    backend.script(r0=Scripted(ok(seq=1), batches=[steps(0, 5, end=True)]),
                   r1=Scripted(engine_error=ENGINE_SAID + "\nits traceback",
                               batches=[steps(1, 3, end=False)]))
    with pytest.raises(DistributedError) as info:
        session.run_cell("train()")
    said = capsys.readouterr().out
    snap = session.last_run
    assert snap is not None
    one = next(r for r in snap.ranks if r.rank == 1)
    assert (one.state, one.error) == (RankState.DIED, "SIGKILL")
    assert row_state(snap, 1) == "died: SIGKILL" and row_state(snap, 0) == "done"
    # the header: the run failed, and its last event is the death, named as the row names it
    html = run_header(snap, final=True)
    assert "failed after" in html
    assert re.search(r"nbdist \d\d:\d\d:\d\d: rank 1 on hostA \(pid 101\) died: SIGKILL", html)
    text = format_summary(snap)
    assert text.startswith("nbdist run: failed after")
    assert "rank 1 on hostA (pid 101) died: SIGKILL" in text
    assert "rank 1 on hostA (pid 101) died: SIGKILL" in said  # printed as it was found
    assert "failed after" in format_line(snap, final=True)
    assert "no end-of-cell report" not in text + html + said
    # the error's line for rank 1 says the same, with the engine's own words below it
    [f] = info.value.failures
    assert (f.rank, f.ename, f.evalue) == (1, "WorkerError", "its worker (pid 101) died: SIGKILL")
    assert f.headline() == "rank 1 on hostA: WorkerError: its worker (pid 101) died: SIGKILL"
    assert str(info.value) == "cell failed on rank 1: WorkerError: its worker (pid 101) died: " \
                              "SIGKILL"
    assert ENGINE_SAID in f.traceback
    assert session.generation == 2  # the group is lost with it: the next cell forms a new one


def test_a_call_the_engine_failed_on_a_worker_still_there_is_no_death(session, backend):
    # nbdist's own code failed in the engine: the worker is alive and the engine knows no end
    backend.script(r0=Scripted(ok(seq=1), batches=[steps(0, 2, end=True)]),
                   r1=Scripted(engine_error="RemoteError: a bug\nits traceback",
                               batches=[steps(1, 2, end=False)]))
    with pytest.raises(DistributedError) as info:
        session.run_cell("train()")
    snap = session.last_run
    assert snap is not None and not snap.marks and not snap.notes
    one = next(r for r in snap.ranks if r.rank == 1)
    assert one.state == RankState.STOPPED
    [f] = info.value.failures
    assert (f.rank, f.ename, f.evalue) == (1, "WorkerError", "RemoteError: a bug")


def test_a_worker_whose_end_the_engine_cannot_tell_is_gone_all_the_same(session, backend):
    dead = backend.ids[1]
    backend.script(r1=Scripted(engine_error=ENGINE_SAID, batches=[steps(1, 1, end=False)]),
                   r0=Scripted(ok(seq=1), batches=[steps(0, 1, end=True)]))
    submit = backend.submit

    def and_the_engine_drops_it(calls):
        job = submit(calls)
        backend.ids.remove(dead)  # the engine no longer has the worker once its call failed
        return job

    backend.submit = and_the_engine_drops_it
    with pytest.raises(DistributedError) as info:
        session.run_cell("train()")
    snap = session.last_run
    assert snap is not None
    assert row_state(snap, 1) == "died: its worker is gone"
    assert "rank 1 on hostA (pid 101) died" in run_header(snap, final=True)
    [f] = info.value.failures
    assert f.evalue == "its worker (pid 101) is gone" and ENGINE_SAID in f.traceback


class Drained:
    """A job whose batches so far are ``batches`` (the pump drains them once)."""

    def __init__(self, batches: list[dict]) -> None:
        self.batches = batches

    def drain_events(self) -> list[dict]:
        out, self.batches = self.batches, []
        return out


class Joins:
    """The elastic coordinator as the pump sees it: reading a replacement's report that it
    healed as rank 1 at the job's step 20, it records the join."""

    def __init__(self) -> None:
        self.records: list[Recovery] = []

    def feed(self, batches: list[dict]) -> None:
        for b in batches:
            for e in b["events"]:
                if e["kind"] == ev.ELASTIC and e.get("joined") == e.get("worker"):
                    self.records.append(Recovery(e["t"], RecoveryKind.JOINED, world_before=1,
                                                 world_after=2, rank=b["rank"],
                                                 step=e["step"]))

    def tick(self) -> None:
        pass

    def news(self) -> list[Recovery]:
        out, self.records = self.records, []
        return out


class Quiet:
    def output(self, batches) -> None:
        pass

    def refresh(self, snapshot, force: bool = False) -> None:
        pass


def test_a_replacements_join_is_recorded_before_the_steps_it_sent_with_it_are_folded():
    run = Run("cell", [0, 1], world_size=2)
    run.feed([dict(steps(1, 20, end=False), rank=1)])  # the worker it replaces: steps 0-19
    healed = ev.elastic(ev.ElasticWhat.HEALED, T0 + 30, run="r", epoch=2, worker="7",
                        joined="7", step=20)
    first = steps(1, 3, end=False)  # its own steps 0-2, in the batch that says it healed
    pump(Drained([{"rank": 1, "seq": 1_000_001, "events": [healed, *first["events"]]}]),
         run, Quiet(), Joins())  # type: ignore[arg-type]
    snap = run.snapshot()
    one = next(r for r in snap.ranks if r.rank == 1)
    assert (one.joined_at, one.steps, one.last_step) == (20, 3, 22)
    [former] = snap.former
    assert (former.steps, former.last_step, former.replaced) == (20, 19, True)
    assert [(m.kind, m.step) for m in snap.marks] == [("joined", 20)]
