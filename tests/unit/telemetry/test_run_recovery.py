"""A run's record through elastic training: steps keep the job's numbering and the world size
they ran at through a rank's death and a replacement's join; the replacement is a row of its
own; the chart marks the moments. Synthetic event streams, folded as the notebook folds them."""

from __future__ import annotations

import re

from synthetic import T0, batches, ddp_job

from nbdist.display.html import run_header, run_summary, step_chart_svg
from nbdist.display.tables import run_table
from nbdist.telemetry import events as ev
from nbdist.telemetry.recovery import Lost, Recovery, RecoveryKind
from nbdist.telemetry.run import Run
from nbdist.telemetry.states import RankState

KEY = "nbdist/elastic/c1/0"


def steps(ns, t0: float, compute: float = 0.05, transfer: float = 0.01) -> list[dict]:
    """Steps ``ns`` (this worker's own numbers) of 0.1 s each from ``t0``, one all-reduce
    bucket each."""
    out = []
    for i, n in enumerate(ns):
        s0 = t0 + i * 0.1
        out.append(ev.comm("all_reduce", s0 + compute, s0 + compute + transfer, 1000, step=n,
                           bucket=0))
        out.append(ev.step(n, s0, s0 + compute + transfer, samples=4,
                           comm_total_s=transfer, comm_exposed_s=transfer, comm_bytes=1000,
                           buckets=1))
    return out


def healed(worker: str, t: float, *, joined=None, step=None, world=2, world_before=1) -> dict:
    return ev.elastic(ev.ElasticWhat.HEALED, t, run=KEY, epoch=1, worker=worker, commit=10,
                      rolled_back=0, discarded=0, seconds=0.5, world=world,
                      world_before=world_before, failures=1, joined=joined,
                      **({"step": step} if step is not None else {}))


class Submission:
    """The story: ranks 0 and 1 train steps 0-9; rank 1's worker dies; rank 0 trains steps
    10-19 alone; a replacement (worker "7") joins at step 20 as rank 1 and both train 20-29."""

    def __init__(self) -> None:
        self.run = Run("cell", [0, 1], world_size=2)
        self.lost = Lost(T0 + 1.05, 1, "hostA", 101, "SIGKILL")

    def before_death(self) -> None:
        for r in (0, 1):
            self.run.feed(batches(r, steps(range(10), T0)))

    def death(self) -> None:
        self.run.feed([{"rank": 0, "seq": 100, "events": [ev.elastic(
            ev.ElasticWhat.FAILED, T0 + 1.02, run=KEY, epoch=0, worker="0", commit=10,
            error="RuntimeError: Connection closed by peer", world=2)]}])

    def found_dead(self) -> None:
        self.run.note_recovery(self.lost)

    def alone(self) -> None:
        self.run.feed([{"rank": 0, "seq": 101, "events": [healed("0", T0 + 1.5, world=1,
                                                                 world_before=2)]}])
        self.run.note_recovery(Recovery(T0 + 1.5, RecoveryKind.FAILURE, [self.lost], 2, 1,
                                        commit=10, seconds=0.5))
        self.run.feed([dict(b, seq=b["seq"] + 101)
                       for b in batches(0, steps(range(10, 20), T0 + 2), per_batch=5)])

    def joins(self) -> None:
        # the replacement reports as rank 1, its batches numbered after the dead worker's; the
        # coordinator reads its report first and records the join (the fold reads no elastic
        # event), as the cell loop does
        self.run.note_recovery(Recovery(T0 + 3.0, RecoveryKind.JOINED, commit=20, seconds=2.0,
                                        world_before=1, world_after=2, rank=1, step=20))
        self.run.feed([{"rank": 1, "seq": 1_000_001,
                        "events": [healed("7", T0 + 3.0, joined="7", step=20)]},
                       {"rank": 0, "seq": 200,
                        "events": [healed("0", T0 + 3.0, joined="7")]}])
        # its own steps count from 0; the job's are 20-29
        self.run.feed([dict(b, seq=b["seq"] + 1_000_001)
                       for b in batches(1, steps(range(10), T0 + 3.1, compute=0.07))])
        self.run.feed([dict(b, seq=b["seq"] + 200)
                       for b in batches(0, steps(range(20, 30), T0 + 3.1))])

    def ends(self) -> None:
        self.run.feed([{"rank": 0, "seq": 300, "events": [ev.end(True, T0 + 5)]},
                       {"rank": 1, "seq": 2_000_000, "events": [ev.end(True, T0 + 5)]}])
        self.run.finish()


def test_a_dead_rank_says_so_the_moment_it_is_known_and_steps_stop_waiting_for_it():
    job = Submission()
    job.before_death()
    job.death()
    snap = job.run.snapshot()
    assert {r.rank: r.state for r in snap.ranks} == {0: RankState.RUNNING, 1: RankState.RUNNING}
    job.found_dead()
    snap = job.run.snapshot()
    one = next(r for r in snap.ranks if r.rank == 1)
    assert one.state == RankState.DIED and one.error == "SIGKILL"
    [row] = [row for row in run_table(snap).rows if row.rank == 1]
    assert row.cells[-1] == "died: SIGKILL" and row.broken
    assert [m.label for m in snap.marks] == ["rank 1 died"] and snap.marks[0].step == 10
    assert "rank 1 on hostA (pid 101) died: SIGKILL" in run_header(snap)
    job.alone()
    snap = job.run.snapshot()
    # rank 0's steps while alone are matched at once, as steps of a world of one
    assert [(p.step, p.ranks) for p in snap.series] == \
        [(n, 2) for n in range(10)] + [(n, 1) for n in range(10, 20)]
    assert snap.steps == 20  # the job's steps, not the dead worker's 10


def test_a_replacement_is_its_own_row_and_keeps_the_jobs_step_numbers():
    job = Submission()
    for part in (job.before_death, job.death, job.found_dead, job.alone, job.joins, job.ends):
        part()
    snap = job.run.snapshot()
    # history as it happened: every step, with the world size it ran at
    assert [(p.step, p.ranks) for p in snap.series] == \
        [(n, 2) for n in range(10)] + [(n, 1) for n in range(10, 20)] + \
        [(n, 2) for n in range(20, 30)]
    assert snap.steps == 30
    zero, one = snap.ranks
    assert (zero.steps, zero.last_step) == (30, 29)
    # the replacement: its own 10 steps, at the job's 20-29, its own compute
    assert (one.steps, one.last_step, one.joined_at, one.state) == (10, 29, 20, RankState.DONE)
    assert one.compute_s is not None and abs(one.compute_s - 0.07) < 1e-6
    # the dead worker keeps its own numbers, apart
    [dead] = snap.former
    assert (dead.rank, dead.steps, dead.last_step, dead.replaced) == (1, 10, 9, True)
    assert dead.state == RankState.DIED and abs(dead.compute_s - 0.05) < 1e-6
    rows = run_table(snap).rows
    assert [(r.rank, r.former) for r in rows] == [(0, False), (1, True), (1, False)]
    assert rows[1].cells[-1] == "died: SIGKILL · replaced"
    assert rows[2].cells[-1] == "done · joined at step 20"
    assert rows[2].cells[2] == "10 steps" and not rows[2].broken
    assert [(m.kind, m.step) for m in snap.marks] == [("died", 10), ("re-formed", 10),
                                                      ("joined", 20)]
    assert "finished in" in run_header(snap, final=True)


def test_the_chart_marks_the_moments_and_keeps_every_step():
    job = Submission()
    for part in (job.before_death, job.death, job.found_dead, job.alone, job.joins, job.ends):
        part()
    snap = job.run.snapshot()
    svg = step_chart_svg(snap.series, marks=snap.marks)
    assert ">step 0<" in svg and ">step 29<" in svg  # nothing dropped, nothing re-scaled
    assert ">rank 1 died<" in svg and ">replacement joined<" in svg
    assert "mean of 1-2 ranks" in svg
    # the rules stand before the first bar of their step: bar 10 and bar 20 of 30
    xs = [float(x) for x in re.findall(r"class='nbdist-mark'><title>[^<]*</title><line "
                                       r"x1='([0-9.]+)'", svg)]
    width = 420 - 56 - 4
    assert [round((x - 56.5) / (width / 30)) for x in xs] == [10, 20]
    # each event once: the last in the header, the earlier ones folded under it (the chart's
    # rules repeat them only as hover text)
    html = re.sub(r"<svg.*?</svg>|title='[^']*'", "", run_summary(snap))  # what is read
    assert html.count("died: SIGKILL") == 2  # the event line and the dead worker's row
    assert html.count("a replacement worker joined") == 1


def test_folding_in_pieces_gives_what_folding_at_once_gives():
    whole, parts = Submission(), Submission()
    for part in (whole.before_death, whole.death, whole.found_dead, whole.alone, whole.joins,
                 whole.ends):
        part()
    parts.before_death()
    parts.run.snapshot()
    for part in (parts.death, parts.found_dead, parts.alone, parts.joins, parts.ends):
        part()
        parts.run.snapshot()
    a, b = whole.run.snapshot(), parts.run.snapshot()
    assert a.series == b.series and a.ranks == b.ranks and a.former == b.former


def test_a_replacement_without_a_step_in_its_report_starts_after_the_latest_step():
    run = Run("cell", [0, 1], world_size=2)
    run.feed(batches(0, steps(range(5), T0)) + [{"rank": 0, "seq": 9,
                                                 "events": [ev.end(True, T0 + 0.5)]}])
    run.note_recovery(Recovery(T0 + 1, RecoveryKind.JOINED, world_before=1, world_after=2,
                               rank=1))  # the replacement's report named no step
    run.feed([{"rank": 1, "seq": 1_000_001, "events": [healed("7", T0 + 1, joined="7")]}])
    run.feed([dict(b, seq=b["seq"] + 1_000_001) for b in batches(1, steps(range(2), T0 + 1))])
    one = next(r for r in run.snapshot().ranks if r.rank == 1)
    assert (one.joined_at, one.last_step) == (5, 6)


def test_a_rank_alone_after_a_death_is_nobodys_straggler():
    run = Run("cell", [0, 1], world_size=2)
    job = ddp_job({0: 0.09, 1: 0.05}, steps=10)  # rank 1 waits for rank 0 in every step
    run.feed(batches(0, job[0]) + batches(1, job[1]))
    assert run.snapshot().stragglers == (0,)
    run.note_recovery(Lost(T0 + 1.1, 1, "hostA", 101, "SIGKILL"))
    snap = run.snapshot()
    assert snap.stragglers == () and "slower" not in run_header(snap)
