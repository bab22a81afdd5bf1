"""Fold telemetry events into a :class:`RunSnapshot`: the numbers every view draws.

Pure: no IPython, widgets, processes or clocks (callers pass ``now``). The run's record
(:class:`~nbdist.telemetry.run.Run`) calls :meth:`RunState.feed` with the event batches of a
run and :meth:`RunState.snapshot` when a view redraws; everything here is unit-tested on
synthetic event streams. When ranks' reports of one step are matched, and how they are split
into waiting and transfer: :mod:`.matching`.

The fold is incremental: an event (or a :func:`~.events.table` of them, read column by
column) updates running state in place: each rank's window of its last :data:`WINDOW` steps,
the matched steps it took part in, the blame of each matched step. A step is matched across
ranks once, when its last report arrives. A snapshot reads that state and visits no event
again, so its cost grows with the number of ranks, not with the length of the run, and
folding a stream in pieces gives what folding it at once gives.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from operator import sub
from typing import Any, Optional, Union

from .columns import (
    column,
    columns,
    logged_columns,
    numbers,
    row,
    summary,
    summary_column,
    table_rows,
    unseal,
)
from .events import (
    COMM,
    DDP,
    DEBUGGER,
    END,
    LOGGED,
    MEMORY,
    PIPELINE,
    PROGRESS,
    PROGRESS_KINDS,
    SCALARS,
    SEALED,
    STACK,
    STAGE,
    STEP,
    TABLE,
    TELEMETRY,
    TRIAL,
    Batch,
    Event,
)
from .matching import (
    STRAGGLER_MIN_S,
    STRAGGLER_MIN_STEPS,
    STRAGGLER_SCORE,
    StepMatcher,
    flagged,
    scores_of,
)
from .ranks import (
    RankFold,
    common_moment,
    figures,
    median_without,
    models_and_trial,
    rank_snapshot,
    to_ns,
)
from .recorded import Recorded
from .recovery import Incarnations, Lost, Recovery, RecoveryKind
from .snapshot import (
    WINDOW,
    BarState,
    Diagnosis,
    DimPoint,
    MemoryPoint,
    ModelPoint,
    PipelinePoint,
    RankSnapshot,
    RunSnapshot,
    StepPoint,
    TrialPoint,
)
from .spread import ScalarSpread, scalar_curves
from .stall.report import StallReport, StallWatch, Stranded
from .stall.thresholds import STALL_WINDOW
from .states import RankState

__all__ = ["STRAGGLER_MIN_S", "STRAGGLER_MIN_STEPS", "STRAGGLER_SCORE", "WINDOW",
           "BarState", "Diagnosis", "DimPoint", "MemoryPoint", "PipelinePoint", "RankSnapshot",
           "RunState", "StepPoint", "UNREPORTED", "aggregate"]

#: what a rank's row says when its run ended before the rank reported its end (a cell's)
UNREPORTED = "no end-of-cell report (interrupted, or the worker died)"

# ----------------------------------------------------------------- the fold
class RunState:
    """Accumulates a run's event batches; :meth:`snapshot` summarizes them.

    Parameters
    ----------
    ranks : sequence of int
        Ranks expected to report (others are added as they appear).
    history : int
        Steps kept for the per-step series and scalar curves (the charts' x-axis).
    started : float, optional
        When the run started (``time.time()``): the hang doctor counts a run that never made
        progress as idle from then.
    stall_after : float, optional
        The user's stall threshold in seconds (0: no stall verdict); default
        :func:`~nbdist.telemetry.stall.report.stall_threshold`'s.
    trace : bool
        Keep the events for a trace file (:meth:`events`); False: count them only (a job
        watched from outside has no trace to write).
    """

    def __init__(self, ranks: Iterable[int] = (), history: int = 300,
                 started: Optional[float] = None, stall_after: Optional[float] = None,
                 trace: bool = True):
        self._window = history
        self._ranks: dict[int, RankFold] = {}
        #: ranks' reports of steps and of collectives outside steps, matched across ranks
        self._matcher = StepMatcher(self._ranks, history)
        for r in ranks:
            self._rank(r)
        #: what the ranks sent, kept for a trace file (or counted only: ``trace=False``)
        self.recorded = Recorded(trace)
        self._t0: Optional[float] = None
        self._t1: Optional[float] = None
        self._bytes = 0
        self._ncomm = 0
        self._dims: dict[str, list] = {}  # dim -> [ops, calls, bytes, nanoseconds]
        #: logged values over the ranks, per step
        self._spread = ScalarSpread(history)
        #: progress, step times and where each rank said it was (the hang doctor's input)
        self.stall = StallWatch(started, stall_after)
        #: which worker each rank's events come from, and what happened to the job
        self.incarnations = Incarnations()
        self._former: list[tuple[int, RankFold]] = []  # workers replacements took over from
        #: what stopped the run (``--timeout 16 s`` or ``interrupt``); None: not stopped
        self.stopped_by: Optional[str] = None
        #: the models and trial of the last snapshot, until a rank reports a change
        self._setup: Optional[tuple[tuple[ModelPoint, ...], Optional[TrialPoint]]] = None

    def _rank(self, rank: int) -> RankFold:
        st = self._ranks.get(rank)
        if st is None:
            st = self._ranks[rank] = RankFold(self._window)
            self._matcher.active += 1
        return st

    def _stop(self, st: RankFold, state: RankState) -> None:
        if st.state.active:
            self._matcher.active -= 1
        st.state = state

    def feed(self, batches: Iterable[Batch]) -> bool:
        """Fold batches in (any order of ranks; per rank in ``seq`` order). True if telemetry.

        Elastic training's events are not read here: what the fold shows of it (a rank that
        died, a replacement's own row) is what its coordinator recorded
        (:meth:`note_recovery`)."""
        changed = False
        for batch in sorted(batches, key=lambda b: (b["rank"], b["seq"])):
            rank = batch["rank"]
            for event in batch["events"]:
                if event.get("kind") in TELEMETRY:
                    self.apply(rank, event)
                    changed = True
        return changed

    def failed_on_exit(self, rank: int, error: str, t: float) -> None:
        """``rank`` failed with ``error`` at ``t``, whatever its end said (see
        :meth:`.Run.failed_on_exit`); a rank already failed keeps its own error."""
        st = self._ranks.get(rank)
        if st is not None and st.state != RankState.FAILED:
            self.apply(rank, {"kind": END, "ok": False, "t": t, "error": error})

    def apply(self, rank: int, e: Event, record: bool = True) -> None:
        """Fold one event (or table of events, or sealed list of them) from ``rank``; kept
        for the trace unless ``record`` is False (one a sealed event held: kept with it)."""
        kind = e["kind"]
        if kind == SEALED:  # unpickled here, one batch at a time: they die young
            self.recorded.add_sealed(rank, e)
            logged = []  # folded together: at 16,384 ranks, the most frequent event
            # after an interrupt, collectives are progress only up to it: read one by one
            for inner in unseal(e, whole=self.stall.interrupted(rank)):
                kind = inner["kind"]
                if kind == LOGGED:  # as a rule: a column per name
                    self._logged(rank, self._rank(rank), inner)
                elif kind == SCALARS:
                    logged.append(inner)
                else:
                    self.apply(rank, inner, record=False)
            if logged:
                self._scalars(rank, self._rank(rank), logged)
            return
        if kind == TABLE:
            self._table(rank, e, record)
            return
        st = self._rank(rank)
        if kind == SCALARS:  # straight there: at a thousand ranks, one a second per rank
            if record:
                self.recorded.add(rank, e, 1)
            self._scalars(rank, st, [e])
            return
        if kind == STACK:  # where the rank is: not a timed event, kept apart from the trace
            self.stall.stack(rank, e)
            if st.state == RankState.WAITING:
                st.state = RankState.RUNNING
            return
        if kind == DEBUGGER:  # stopped for the notebook, or went on: the hang doctor's too
            self.stall.debugger(rank, e)
        if kind == DDP:  # what a model runs with, and a trial's end: kept apart likewise
            st.models[e["model"]] = e
            self._setup = None
            return
        if kind == TRIAL:
            st.trial = e
            self._setup = None
            return
        if kind != END and record:
            self.recorded.add(rank, e, 1)
        self._fold(rank, st, e)

    def _fold(self, rank: int, st: RankFold, e: Event) -> None:
        kind = e["kind"]
        t = e.get("t1", e.get("t"))
        if t is not None:
            self._span(e.get("t0", t), t)
        if st.state == RankState.WAITING and kind != END:
            st.state = RankState.RUNNING
        if kind in PROGRESS_KINDS and t is not None:
            self.stall.progress(t, rank)
        if kind == STEP:
            length = e["t1"] - e["t0"]
            self.stall.step(length, e["t1"], rank)
            timed = e.get("comm_timed", True)
            self._steps(rank, st, [e["step"]], [e["t0"]], [e["t1"]], [length], [e["samples"]],
                        [e["comm_exposed_s"]], None if timed else [(False, e["comm_bytes"])])
        elif kind == COMM:
            self._bytes += e["bytes"]
            self._ncomm += 1
            if e.get("step") is not None:
                st.add_collective(e["step"], e["t0"], e["t1"], e["bytes"],
                                  e.get("measured") == "untimed")
            else:
                self._matcher.collective(rank, e["op"], e["t0"], e["t1"], e["bytes"])
            if e.get("dim") is not None:
                self._dim(e["dim"], e["op"], e["bytes"], e["t1"] - e["t0"])
        elif kind == STAGE:
            st.stage_s.setdefault(e["op"], deque(maxlen=WINDOW * 8)).append(e["t1"] - e["t0"])
        elif kind == PIPELINE:
            st.pipes.append(e)
        elif kind == PROGRESS:
            st.progress(e)
        elif kind == SCALARS:
            self._scalars(rank, st, [e])
        elif kind == MEMORY:
            self._memory(st, e)
        elif kind == END:
            error = e.get("error")
            if not e["ok"] and self.stopped_by and (error or "").startswith("KeyboardInterrupt"):
                self._stop(st, RankState.STOPPED)  # what stopped it is the run's to say
                error = None
            else:
                self._stop(st, RankState.DONE if e["ok"] else RankState.FAILED)
            st.error = error
            self.stall.end(rank, e["t"], e["ok"], st.error)
            self._matcher.settle_all()  # steps this rank will never report no longer wait for it

    def _scalars(self, rank: int, st: RankFold, logged: Sequence[Event]) -> None:
        """Logged values (``scalars`` events of ``rank``, in order; they are not progress)."""
        ts = [t for e in logged if (t := e.get("t")) is not None]
        if ts:
            self._span(min(ts), max(ts))
        if st.state == RankState.WAITING:
            st.state = RankState.RUNNING
        self._spread.add_all(rank, st.log(logged))

    def _logged(self, rank: int, st: RankFold, e: Event) -> None:
        """:meth:`_scalars` for logged values as columns (:func:`~.columns.logged`)."""
        ts, steps, values = logged_columns(e)
        self._span(min(ts), max(ts))
        if st.state == RankState.WAITING:
            st.state = RankState.RUNNING
        add = self._spread.add_columns
        for name, xs, vs in st.log_columns(e["names"], steps, values):
            add(rank, name, xs, vs)

    @staticmethod
    def _memory(st: RankFold, e: Event) -> None:
        if st.memory is None or e["params"] or e["grads"] or e["optimizer"]:
            # A cell's last sample comes after its locals are gone: keep what the rank
            # held while it trained.
            st.memory = e
            st.memory_point = None

    def _span(self, t0: float, t1: float) -> None:
        # min() and max(), inline: called several times a batch
        if self._t0 is None or t0 < self._t0:
            self._t0 = t0
        if self._t1 is None or t1 > self._t1:
            self._t1 = t1

    def _dim(self, dim: str, op: str, nbytes: int, seconds: float) -> None:
        d = self._dims.setdefault(dim, [set(), 0, 0, 0])
        d[0].add(op)
        d[1] += 1
        d[2] += nbytes
        d[3] += to_ns(seconds)

    # ------------------------------------------------------------- tables, column by column
    def _table(self, rank: int, t: Event, record: bool = True) -> None:
        """Fold a table: what one event at a time would do, with the hot loops on columns.

        A table's collectives are folded before its steps (a step looks up its collectives
        when it lands, and a worker sends a step's collectives before the step).
        """
        st = self._rank(rank)
        if record:
            self.recorded.add(rank, t, table_rows(t))
        if st.state == RankState.WAITING:
            st.state = RankState.RUNNING
        folded = self._summed_steps(rank, st, t["parts"])
        for part in sorted(t["parts"], key=lambda p: p["of"] != COMM):
            if folded and (part is folded[0] or part is folded[1]):
                continue
            kind = part["of"]
            if kind == COMM and "steps" in part:
                self._comm_summary(rank, st, part)
                continue
            if kind == STEP:
                self._step_columns(rank, st, part)
                continue
            if kind == MEMORY:
                self._span(*st.memory_columns(part))
                continue
            if kind == COMM:
                self._comm_columns(rank, st, columns(part))
            else:  # rarer kinds: one event at a time
                for i in range(part["n"]):
                    self._fold(rank, st, row(part, i))

    def _summed_steps(self, rank: int, st: RankFold, parts: Sequence[Event]
                      ) -> Optional[tuple[Event, Event]]:
        """A table's steps and its one part of collectives, when that part's summary tells
        exactly those steps, all timed (a training rank's batch, as a rule), folded together:
        what :meth:`_comm_summary` then :meth:`_step_columns` would do, with a report made
        only for each step matched across ranks (:attr:`.StepMatcher.every`). Returns the
        two parts; None where the table is not of that form (they are folded one by one)."""
        comms = [p for p in parts if p["of"] == COMM]
        steps = [p for p in parts if p["of"] == STEP]
        if (len(comms) != 1 or len(steps) != 1 or "steps" not in comms[0]
                or self.stall.interrupted(rank)):
            return None
        comm, step = comms[0], steps[0]
        if "comm_timed" in step["fields"] and not all(column(step, "comm_timed")):
            return None
        # Views of the columns: of a long batch, the fold reads the last WINDOW steps, the
        # few matched ones, and the ends
        ns = numbers(step, "step")
        told_ns = comm["steps"]["step"]  # the same packed bytes, as a rule: no need to decode
        if ((told_ns != step["columns"][step["fields"].index("step")]
             and list(numbers(comm, "step", summed=True)) != list(ns))
                or (st.comm and any(n in st.comm for n in ns))):
            return None
        self._comm_totals(rank, comm)
        t0s, t1s = numbers(step, "t0"), numbers(step, "t1")
        span = (step["t0"], step["t1"]) if "t1" in step else (min(t0s), max(t1s))
        self._span(*span)
        self.stall.progress(span[1], rank)
        w = -max(WINDOW, STALL_WINDOW)
        tail = (list(t0s[w:]), list(t1s[w:]))
        lengths = list(map(sub, tail[1], tail[0]))  # of the tail: all the windows keep
        self.stall.steps_all(lengths, tail[1], rank)
        first, off, every = ns[0] + st.offset, st.offset, self._matcher.every
        if every <= 1:
            keep: Sequence[int] = range(len(ns))
        elif ns[-1] - ns[0] == len(ns) - 1:  # consecutive, as a rule: no loop
            keep = range(-first % every, len(ns), every)
        else:
            keep = [i for i, n in enumerate(ns) if not (n + off) % every]
        told = [numbers(comm, k, summed=True) for k in ("bytes", "timed", "untimed", "busy")]
        reports = st.add_summed_steps(ns, t0s, t1s, tail, lengths, numbers(step, "samples"),
                                      numbers(step, "comm_exposed_s"), told, keep)
        self._matcher.steps(rank, [ns[i] + off for i in keep], reports)
        return comm, step

    def _comm_totals(self, rank: int, part: Event) -> None:
        """What a part of summed collectives adds to the run: its span, bytes and count, and
        the rank's progress."""
        self._span(part["t0"], part["t1"])
        if self.stall.interrupted(rank):  # only what came before the interrupt is progress
            self.stall.progress_all(column(part, "t1"), rank)
        else:
            self.stall.progress(part["t1"], rank)
        self._bytes += part["bytes"]
        self._ncomm += part["n"]

    def _comm_summary(self, rank: int, st: RankFold, part: Event) -> None:
        """Collectives of steps, from what the worker summed of them (see :mod:`.columns`)."""
        self._comm_totals(rank, part)
        comm = st.comm
        steps = summary_column(part, "step")
        if any(s in comm for s in steps):  # a step whose collectives came in two batches
            for s, nbytes, timed_bytes, untimed, _, spans in summary(part):
                st.add_collectives(s, nbytes, timed_bytes, untimed,
                                   [x for span in spans for x in span])
            return
        # All of these steps' collectives so far: each kept as the summary told it (bytes,
        # timed bytes, untimed, busy; the part and row to read its intervals from if more
        # collectives of the step come)
        for i, step in enumerate(zip(steps, *(summary_column(part, k)
                                              for k in ("bytes", "timed", "untimed",
                                                        "busy")))):
            comm[step[0]] = (*step[1:], part, i)

    def _comm_columns(self, rank: int, st: RankFold, cols: dict[str, list[Any]]) -> None:
        t0s, t1s, nbytes, steps = cols["t0"], cols["t1"], cols["bytes"], cols["step"]
        self._span(min(t0s), max(t1s))
        self.stall.progress_all(t1s, rank)
        self._bytes += sum(nbytes)
        self._ncomm += len(t0s)
        measured = cols.get("measured") or [None] * len(t0s)
        for i, (s, a, z, b, m) in enumerate(zip(steps, t0s, t1s, nbytes, measured)):
            if s is None:
                self._matcher.collective(rank, cols["op"][i], a, z, b)
            else:
                st.add_collective(s, a, z, b, m == "untimed")
        dims = cols.get("dim")
        if dims is not None:
            for i, d in enumerate(dims):
                if d is not None:
                    self._dim(d, cols["op"][i], nbytes[i], t1s[i] - t0s[i])

    def _step_times(self, rank: int, part: Event
                    ) -> tuple[list[float], list[float], list[float]]:
        """A step part's starts, ends and lengths, into the run's span and the hang doctor's
        record of progress and step times."""
        t0s, t1s = column(part, "t0"), column(part, "t1")  # the columns the fold reads
        self._span(min(t0s), max(t1s))
        self.stall.progress_all(t1s, rank)
        lengths = list(map(sub, t1s, t0s))
        self.stall.steps_all(lengths, t1s, rank)
        return t0s, t1s, lengths

    def _step_columns(self, rank: int, st: RankFold, part: Event) -> None:
        t0s, t1s, lengths = self._step_times(rank, part)
        untimed = None
        if "comm_timed" in part["fields"]:
            flags = column(part, "comm_timed")
            if not all(flags):
                untimed = list(zip(flags, column(part, "comm_bytes")))
        self._steps(rank, st, column(part, "step"), t0s, t1s, lengths,
                    column(part, "samples"), column(part, "comm_exposed_s"), untimed)

    def _steps(self, rank: int, st: RankFold, ns: Sequence[int], t0s: Sequence[float],
               t1s: Sequence[float], lengths: Sequence[float], samples: Sequence[int],
               exposed: Sequence[float],
               timing: Optional[Sequence[tuple[bool, int]]] = None) -> None:
        """Steps ``ns`` of ``rank``, in order: its window, and each step's report, matched
        across ranks once the last one arrives (``timing``: :meth:`.RankFold.add_steps`)."""
        reports, untimed_bytes = st.add_steps(ns, t0s, t1s, lengths, samples, exposed, timing)
        self._bytes += untimed_bytes
        self._matcher.steps(rank, st.job_steps(ns), reports)

    # ------------------------------------------------------------- elastic training
    def _replaced(self, rank: int, start: int) -> None:
        """A replacement worker reports as ``rank`` from now on: it gets a fold of its own,
        counting from the job's step ``start`` it joined at."""
        old = self._ranks.pop(rank, None)
        if old is not None:
            if old.state.active:  # its death was not reported; its place was taken
                self._stop(old, RankState.DIED)
            old.replaced = True
            self._former.append((rank, old))
        new = self._rank(rank)
        new.offset = new.joined_at = start
        new.state = RankState.RUNNING

    def _next_step(self) -> int:
        """The job's next step: after the latest any rank reported."""
        return max((st.last_step for st in self._ranks.values() if st.last_step is not None),
                   default=-1) + 1

    def note_recovery(self, news: Union[Lost, Recovery]) -> None:
        """What the notebook found or decided (:mod:`.recovery`): a :class:`Lost` rank's row
        says it died from now on, and steps stop waiting for it; a replacement that joined
        (elastic training's ``JOINED`` record) reports as its rank from now on, in a fold of
        its own. Each is kept as a mark at the step it happened."""
        died_at = self._next_step()
        joined_at = None
        if isinstance(news, Lost):
            if news.rank in self._ranks:
                st = self._ranks[news.rank]
                self._stop(st, RankState.DIED)
                st.error = news.reason
                died_at = st.last_step + 1 if st.last_step is not None else None
                self._matcher.settle_all()
        elif news.kind is RecoveryKind.JOINED:
            joined_at = self.incarnations.joined(news, died_at)
            if joined_at is not None and news.rank is not None:
                self._replaced(news.rank, joined_at)
        if joined_at is None:
            joined_at = max(self.incarnations.offset.values(), default=None)
        self.incarnations.record(news, died_at, joined_at)

    def finish(self, unreported: str = UNREPORTED) -> None:
        """The run is over: ranks that never said they finished are marked stopped, with
        ``unreported`` as what their rows say of it (a cell's words by default)."""
        for st in self._ranks.values():
            if st.state.active:
                self._stop(st, RankState.STOPPED)
                if not self.stopped_by:
                    st.error = st.error or unreported
        self._matcher.settle_all()

    def missed_start(self, rank: int) -> None:
        """``rank``'s first reports went elsewhere (to the notebook a watched job reported
        to before this one): its step count starts from the first step it reports here."""
        st = self._rank(rank)
        if st.steps == 0:
            st.counts_from_index = True

    # ------------------------------------------------------------- snapshot
    def snapshot(self, now: Optional[float] = None, at: Optional[float] = None) -> RunSnapshot:
        """The current summary; ``now`` (worker clock) makes progress ETAs count down, ``at``
        (the notebook's ``time.time()``) is when a stall is judged (None: not judged)."""
        ranks = sorted(self._ranks)
        matcher = self._matcher
        # A rank that died waits for nobody and is waited for by nobody any more; alone, a
        # rank is nobody's straggler.
        live = [r for r in ranks if self._ranks[r].state != RankState.DIED]
        scores = scores_of(list(matcher.blames), live)
        slow = flagged(scores, len(matcher.blames)) if len(live) > 1 else []
        flagged_set = set(slow)
        cutoff = matcher.matched - WINDOW  # match numbers of the run's last WINDOW matches
        numbers = [figures(self._ranks[r], cutoff) for r in ranks]
        known = sorted(f[3] for f in numbers if f[3] is not None)  # compute per step
        moment = common_moment(self._ranks.values())
        out = []
        for r, f in zip(ranks, numbers):
            c = f[3]
            others = median_without(known, c) if c is not None else None
            score = scores[r].score if r in scores else 0.0
            out.append(rank_snapshot(r, self._ranks[r], f, now, r in flagged_set, score,
                                     c - others if others is not None else None, moment))
        former = tuple(rank_snapshot(r, st, figures(st, cutoff), now, False, 0.0, None)
                       for r, st in self._former)
        elapsed = (self._t1 - self._t0) if self._t0 is not None and self._t1 is not None else 0.0
        curves = scalar_curves(self._ranks, self._former)
        dims = tuple(DimPoint(dim, tuple(sorted(d[0])), d[1], d[2], d[3] / 1e9)
                     for dim, d in sorted(self._dims.items()))
        stall = self.stall_report(at) if at is not None else None
        running = stall is None and any(st.state.active for st in self._ranks.values())
        models, trial = self._setup = self._setup or models_and_trial(self._ranks)
        return RunSnapshot(tuple(out), tuple(matcher.series[s] for s in sorted(matcher.series)),
                           tuple(slow), elapsed, self._bytes, self._ncomm, curves, dims=dims,
                           stall=stall, scalar_spread=self._spread.series(), former=former,
                           marks=tuple(self.incarnations.marks), stopped_by=self.stopped_by,
                           models=models, trial=trial, idle_s=self.stall.quiet(at, running))

    def _states(self) -> dict[int, RankState]:
        return {r: st.state for r, st in self._ranks.items()}

    def stall_report(self, at: float) -> Optional[StallReport]:
        """The hang doctor's report at ``at``: where each rank is (None: no stall past the
        threshold)."""
        return self.stall.stall_report(self._ranks, self._states, at)

    def stranded(self, at: float) -> Optional[Stranded]:
        """Ranks that finished while others wait in a collective they will never call
        (:meth:`~nbdist.telemetry.stall.report.StallWatch.stranded`); None: none."""
        return self.stall.stranded(self._ranks, self._states(), at)

    def where(self, at: float) -> Optional[StallReport]:
        """Where each rank was by its last report, threshold or not (for the error a timeout
        or an interrupt raises); None when no rank reported where it was."""
        return self.stall.where(self._ranks, self._states(), at)

    def events(self) -> dict[int, list[Event]]:
        """The recorded telemetry events per rank (for a trace file), tables expanded."""
        return self.recorded.events()


def aggregate(batches: Iterable[Batch], ranks: Iterable[int] = ()) -> RunSnapshot:
    """Fold ``batches`` at once (tests, and summaries of a finished run)."""
    batches = list(batches)
    # every rank that sent anything is expected: steps are split once all of them reported
    state = RunState(sorted(set(ranks) | {b["rank"] for b in batches}))
    state.feed(batches)
    return state.snapshot()
