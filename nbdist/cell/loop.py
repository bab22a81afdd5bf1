"""The cell loop: one job of per-rank calls, from submission to results or one error.

:class:`CellRun` submits the calls through the job's :class:`~nbdist.group.membership.Membership`,
then polls: each pass moves the event batches received so far into the run's record and onto
the screen (:func:`pump`), lets the elastic coordinator decide (when the cell is elastic), and
checks the cell's time limit. When the calls are done it waits briefly for their last batches,
records each worker the engine lost (a :class:`~nbdist.telemetry.recovery.Lost` rank, as the
elastic coordinator records one: its row, the header and the error then name the same death),
closes the view, and turns failed ranks into one :class:`~nbdist.errors.DistributedError`.

Companions work beside the job in the same loop (:class:`Companion`): the debugger's console,
which answers the ranks' prompts through the kernel's stdin, and faults made on purpose.
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Protocol

from ..backends.base import Call, Outcome, Submission, poll_until, wait_all
from ..errors import (
    REBUILD_DDP,
    CellInterrupted,
    CellTimeoutError,
    RankFailure,
    RanksFinishedError,
    RanksRestarted,
    cell_error,
)
from ..group.losses import live_workers, lost_worker, oom_kills
from ..runtime import results
from ..telemetry.events import Batch
from ..telemetry.recovery import Lost
from ..telemetry.run import Run
from ..telemetry.snapshot import RunSnapshot
from .interrupt import stop_ranks

if TYPE_CHECKING:
    from ..elastic.coordinator import Coordinator
    from ..group.membership import Membership

# After a cell ends, how long we wait for its last output batches to arrive. Batches travel on
# the engine's IO channel, the result on another: on a loaded machine they have been seen more
# than 3 s behind the result (a Trainer's last logged values missing from the record). Waiting
# costs nothing when they are there; the full wait is paid only for batches that never come.
_EVENT_GRACE = 10.0
# How often the kernel looks at a running job: output and the dashboard move at this pace.
_POLL = 0.1
#: what stopped a cell whose running ranks wait in a collective that finished ranks never call
PEERS_FINISHED = "peers that finished"


class RunView(Protocol):
    """Where a run is shown while it runs (``display.make_run_view`` makes one): the
    cell loop hands it output and snapshots, and knows nothing of the medium."""

    def output(self, batches: Iterable[Batch]) -> None: ...

    def refresh(self, snapshot: Callable[[], RunSnapshot], force: bool = False) -> None: ...

    def close(self, snap: RunSnapshot) -> None: ...


class Companion(Protocol):
    """Works beside a running job in the kernel's loop: it reads the job's event batches
    (:meth:`feed`) and acts on each pass (:meth:`tick`, which may wait for the user)."""

    def feed(self, batches: Sequence[Batch]) -> None: ...

    def tick(self, running: Collection[int]) -> None:
        """A pass of the loop; ``running``: the ranks whose calls have not returned."""

    def paused(self) -> float:
        """Seconds of the job so far that its time limit does not count (waiting for the
        user at a prompt)."""

    def close(self) -> None: ...


class CellName(NamedTuple):
    """How a cell is named: the file in its tracebacks, and ``In [12]`` in error headlines."""

    filename: str
    label: Optional[str]


def cell_name(n: int, execution_count: Optional[int] = None) -> CellName:
    """``<distributed cell [12]>`` / ``In [12]`` where the kernel numbers the cell, else the
    session's own count ``<distributed cell 3>`` and no label."""
    if execution_count is not None:
        return CellName(f"<distributed cell [{execution_count}]>", f"In [{execution_count}]")
    return CellName(f"<distributed cell {n}>", None)


def cell_label(filename: str) -> Optional[str]:
    """The label of the cell a :func:`cell_name` filename names (``In [12]``); None for one
    the kernel did not number, or a filename that is not a cell's."""
    m = re.fullmatch(r"<distributed cell \[(\d+)\]>", filename)
    return f"In [{m.group(1)}]" if m else None


def pump(job: Submission, run: Run, view: RunView, coordinator: Optional[Coordinator] = None,
         carried: Sequence[Batch] = (), companions: Sequence[Companion] = (),
         redraw: bool = True, release: bool = False) -> None:
    """Move the batches received so far, and those the results ``carried``, into the run's
    record and onto the screen, each rank's in the order it sent them
    (:meth:`~nbdist.telemetry.run.Run.in_order`; ``release``: the last pass, none waits); the
    elastic coordinator and the companions read them too, and what the coordinator decides
    goes into the record. The view is asked to redraw on every pass, news or not: its clocks
    tick (its own rate limit says when it draws); not with ``redraw`` False (the view is
    closed next, and draws the run's end)."""
    batches = run.in_order([*job.drain_events(), *carried], release)
    news = False
    if coordinator is not None:
        # The coordinator reads them first: a replacement that joined is in the record (a row
        # of its own) before the steps it reported in the same batches are folded.
        coordinator.feed(batches)
        news = _note_news(run, coordinator)
    if batches:
        view.output(batches)
        run.feed(batches)
        for c in companions:
            c.feed(batches)
    news |= run.stall_news()  # the hang doctor's verdict appeared or changed: show it now
    if coordinator is not None:
        coordinator.tick()
        news |= _note_news(run, coordinator)
    if redraw:
        view.refresh(run.snapshot, force=news)


def _note_news(run: Run, coordinator: Coordinator) -> bool:
    """Hand what the coordinator recorded since the last call to the run's record; True
    when there was some."""
    records = coordinator.news()
    for record in records:
        run.note_recovery(record)  # the views show it once, each in its medium
    return bool(records)


class CellRun:
    """Per-rank ``calls`` running as one job, streamed into ``run`` and ``view``.

    With a ``coordinator``, ``nbdist.elastic.run`` calls in the cell are coordinated (see
    :mod:`nbdist.elastic.coordinator`): it may re-form the group in the membership while the
    cell runs. ``hint`` is added to a time-out's message.
    """

    def __init__(self, membership: Membership, calls: list[Call], run: Run, view: RunView, *,
                 coordinator: Optional[Coordinator] = None, hint: str = "",
                 companions: Sequence[Companion] = ()) -> None:
        self.membership, self.calls, self.run, self.view = membership, calls, run, view
        self.coordinator, self.hint, self.companions = coordinator, hint, companions
        #: worker -> the rank it reports as (a replacement worker takes the lost rank's slot)
        self.slots: dict[Any, int] = (coordinator.slots if coordinator is not None else
                                      {p.worker_id: p.rank for p in membership.plans})
        self.job: Optional[Submission] = None
        #: ranks an interrupt could not stop, whose processes the engine replaced
        self.restarted: Optional[RanksRestarted] = None
        #: workers the engine lost during the cell, as recorded (see :meth:`_note_lost`)
        self.lost: dict[Any, Lost] = {}
        self._oom = 0  # out-of-memory kills counted before the cell
        #: workers whose call returned while others ran, their last batch folded already
        self._folded: set[Any] = set()

    @property
    def reformed(self) -> bool:
        """An elastic run, or the restart of ranks an interrupt could not stop, formed a new
        group during the cell."""
        return self.restarted is not None or (self.coordinator is not None
                                              and self.coordinator.final() is not None)

    def wait(self, timeout: Optional[float]) -> list[results.CellResult]:
        """Run the calls to the end (or ``timeout`` seconds) and return each call's result,
        in call order; raise one error naming every rank that failed."""
        run, coordinator = self.run, self.coordinator
        self._oom = oom_kills()
        job = self.job = self.membership.submit(self.calls)
        if coordinator is not None:
            coordinator.follow(job)
            job = self.job = CompositeSubmission(job, coordinator.joiner_jobs)
        start, companions = time.monotonic(), self.companions
        try:
            while True:
                done = job.wait(_POLL)
                if done and (coordinator is None or not coordinator.coordinating):
                    break  # _finish moves what is left onto the screen, in one pass
                pump(job, run, self.view, coordinator, companions=companions)
                if done and job.wait(0):  # not if the pump let a replacement in just now
                    break
                if coordinator is not None and coordinator.wrap_up_needed(job.pending()):
                    coordinator.wrap_up()  # training ended before a replacement got in
                for c in companions:
                    c.tick({self.slots.get(w, -1) for w in job.pending()})
                self._fold_returned(job)
                elastic = coordinator is not None and coordinator.coordinating
                stranded = None if elastic else run.stranded()  # elastic runs re-form groups
                if stranded is not None:  # no call can complete: end it now, not at a timeout
                    run.stopped(PEERS_FINISHED)
                    late = self._late()
                    restarted = self._interrupt()
                    self._finish()
                    # where the ranks were when the notebook saw no call could complete, if
                    # the interrupt's own reports did not arrive (a rank's last batch can)
                    where = run.where() or stranded.report
                    raise RanksFinishedError(stranded, late, where, run.label, run.what,
                                             restarted)
                # time spent at a prompt is the user's, not the cell's
                paused = sum(c.paused() for c in companions)
                if timeout is not None and time.monotonic() - start - paused > timeout:
                    run.stopped(f"--timeout {timeout:g} s")
                    late = self._late()
                    restarted = self._interrupt()
                    self._finish()  # with where each rank said it was
                    raise CellTimeoutError(timeout, late, self.hint, run.where(), run.label,
                                           restarted)
        except KeyboardInterrupt:
            run.stopped("interrupt")
            late = self._late()
            restarted = self._interrupt()
            self._finish()
            raise CellInterrupted(late, run.where(), run.label, run.what, restarted) from None
        finally:
            self._finish()
            for c in companions:
                c.close()
        return self._results(job.outcomes())

    def _cell_outcomes(self, outcomes: list[Outcome]) -> list[Outcome]:
        """The outcomes that are the cell's own."""
        final = self.coordinator.final() if self.coordinator is not None else None
        if final is None:
            return outcomes
        # The job is now the elastic run's last membership: calls of workers it lost are not
        # failures of the cell (it carried on without them).
        members = set(final.members)
        return [o for o in outcomes if o.worker in members or o.engine_error is None]

    def _results(self, outcomes: list[Outcome]) -> list[results.CellResult]:
        outcomes = self._cell_outcomes(outcomes)
        out = [o.value if o.engine_error is None else self._engine_failure(o)
               for o in outcomes]
        # The engine failed these calls: their worker may be gone; check before the next job.
        self.membership.distrust([o.worker for o in outcomes if o.engine_error is not None])
        group_lost = any(not r["group_alive"] for r in out)
        if group_lost:
            self.membership.invalidate()
        hosts = {w: i["hostname"] for w, i in self.membership.infos.items()}
        failures = [RankFailure.from_result(self.slots[o.worker], hosts.get(o.worker, "?"), r,
                                            cell=self.run.label)
                    for o, r in zip(outcomes, out) if not r["ok"]]
        if failures:
            hint = self.hint
            if not any(f.communication for f in failures):
                hint = ""  # the hint is about collectives; this failure is in the code
            remedy = REBUILD_DDP if group_lost else ""
            raise cell_error(failures, what=self.run.what,
                             remedy=" ".join(x for x in (hint, remedy) if x))
        return out

    def _engine_failure(self, o: Outcome) -> results.CellResult:
        """The result of a call the engine failed: for a worker it lost, the death as its
        row says it (the engine's own words below, as the traceback)."""
        assert o.engine_error is not None
        lost = self.lost.get(o.worker)
        if lost is None and self.coordinator is not None:
            lost = self.coordinator.found_lost.get(o.worker)
        if lost is None:
            return results.engine_failure(o.engine_error)
        return results.cell_failed(results.plain_error("WorkerError", lost.gone(),
                                                       lost.said() + o.engine_error),
                                   group_alive=False)

    def _note_lost(self, outcomes: list[Outcome]) -> None:
        """Record each worker the engine lost during the cell (its call failed, and its
        process is gone or the engine says how it ended) as a :class:`Lost` rank, as the
        elastic coordinator records the members it finds dead (those are not recorded
        twice). A call the engine failed on a worker that is still there is no death."""
        known = self.coordinator.found_lost if self.coordinator is not None else {}
        failed = [o.worker for o in self._cell_outcomes(outcomes)
                  if o.engine_error is not None and o.worker not in known]
        if not failed:
            return
        live = live_workers(self.membership, self.slots)
        for w in failed:
            lost = lost_worker(self.membership, w, self.slots.get(w), self._oom, by="nbdist")
            if w in live and lost.cause is None:
                continue
            self.lost[w] = lost
            self.run.note_recovery(lost)

    def _fold_returned(self, job: Submission) -> None:
        """Fold the last batch of each call that returned while others still run, once the
        batches it sent before have arrived: its row then says the rank finished (or failed)
        at once, and the hang doctor knows it ended rather than that it went silent.

        A running job's :meth:`~nbdist.backends.base.Submission.outcomes` answers for the
        calls that returned (every engine files a call's outcome as it returns); only those
        are read.
        """
        pending = set(job.pending())
        if not pending or not ({c.worker for c in self.calls} - pending - self._folded):
            return
        tails = []
        for o in job.outcomes():
            rank = self.slots.get(o.worker)
            if o.worker in pending or o.worker in self._folded or rank is None:
                continue
            if o.engine_error is not None:
                self._folded.add(o.worker)  # nothing to fold: the end names the engine's error
                continue
            if o.value["seq"] and not self.run.has_all({rank: o.value["seq"]}):
                continue  # its earlier batches are still on their way
            self._folded.add(o.worker)
            if o.value.get("tail"):
                tails.append(o.value["tail"])
        if tails:
            pump(job, self.run, self.view, self.coordinator, tails, self.companions)

    def _late(self) -> list[int]:
        assert self.job is not None
        return sorted(self.slots[w] for w in self.job.pending())

    def _finish(self) -> None:
        """Show every batch the finished calls sent (their results say how many), then close.

        The run's record counts what was already drained while the calls ran: a rank that
        finished early may have had its last batch drained before the others returned.
        """
        run, view, coordinator, job = self.run, self.view, self.coordinator, self.job
        if run.ended is not None or job is None:
            return  # finished already (a timeout or an interrupt shows its view first)
        if not job.pending():
            returned = [o for o in job.outcomes() if o.engine_error is None]
            wanted = {self.slots.get(o.worker): o.value["seq"] for o in returned
                      if o.value["seq"]}

            def drained() -> bool:
                pump(job, run, view, coordinator, companions=self.companions, redraw=False)
                return run.has_all(wanted)

            # Batches arrive on the engine's IO thread, which offers nothing to wait on (a
            # cell that sent none, only the last batch its result carries, waits for nothing)
            if wanted:
                poll_until(drained, _EVENT_GRACE, interval=0.001)
            # then each rank's last batch, after all it sent before it
            tails = [o.value["tail"] for o in returned
                     if o.value.get("tail") and o.worker not in self._folded]
            pump(job, run, view, coordinator, tails, companions=self.companions, redraw=False,
                 release=True)
            self._note_lost(job.outcomes())  # before the view draws the run's end
        else:
            pump(job, run, view, coordinator, companions=self.companions, redraw=False,
                 release=True)
        run.finish()
        view.close(run.snapshot())

    def _interrupt(self) -> Optional[RanksRestarted]:
        """Stop the ranks still running; the group is out of date from now on (formed again
        at once where ranks that did not stop were restarted)."""
        assert self.job is not None
        self.membership.invalidate()
        self.restarted = stop_ranks(self.membership, self.job, self.slots)
        return self.restarted


class CompositeSubmission(Submission):
    """The cell's job plus the jobs of replacement workers that join it (``joiners``: the
    elastic coordinator's list, which grows while the cell runs), waited on as one."""

    def __init__(self, first: Submission, joiners: list[tuple[Any, Submission]]) -> None:
        self.first, self.joiners = first, joiners

    def _all(self) -> list[Submission]:
        return [self.first] + [j for _, j in self.joiners]

    def wait(self, timeout: Optional[float]) -> bool:
        return wait_all(self._all(), timeout)

    def pending(self) -> list[Any]:
        return [w for j in self._all() for w in j.pending()]

    def outcomes(self) -> list[Outcome]:
        return [o for j in self._all() for o in j.outcomes()]

    def drain_events(self) -> list[Batch]:
        return [b for j in self._all() for b in j.drain_events()]
