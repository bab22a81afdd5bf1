"""Fold telemetry events into a :class:`RunSnapshot`: the numbers every view draws.

Pure: no IPython, widgets, processes or clocks (callers pass ``now``). The run's record
(:class:`~nbdist.telemetry.run.Run`) calls :meth:`RunState.feed` with the event batches of a
run and :meth:`RunState.snapshot` when a view redraws; everything here is unit-tested on
synthetic event streams. How ranks' reports of one step are matched and split into waiting and
transfer: :mod:`.matching`.

The fold is incremental: an event (or a :func:`~.events.table` of them, read column by
column) updates running state in place: each rank's window of its last :data:`WINDOW` steps,
the matched steps it took part in, the blame of each matched step. A step is matched across
ranks once, when its last report arrives. A snapshot reads that state and visits no event
again, so its cost grows with the number of ranks, not with the length of the run, and
folding a stream in pieces gives what folding it at once gives.
"""

from __future__ import annotations

import pickle
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from math import fsum
from typing import Any, Optional

from .columns import column, columns, row, rows, summary, summary_column, table_rows
from .events import (
    COMM,
    END,
    MEMORY,
    PIPELINE,
    PROGRESS,
    PROGRESS_KINDS,
    SCALARS,
    STACK,
    STAGE,
    STEP,
    TABLE,
    TELEMETRY,
    Batch,
    Event,
)
from .intervals import union_seconds
from .matching import (
    STRAGGLER_MIN_S,
    STRAGGLER_MIN_STEPS,
    STRAGGLER_SCORE,
    MatchedCollective,
    blame,
    flagged,
    match_step,
    scores_of,
)
from .ranks import (
    RankFold,
    accumulator,
    figures,
    median_without,
    rank_snapshot,
    to_ns,
)
from .snapshot import (
    WINDOW,
    BarState,
    Diagnosis,
    DimPoint,
    MemoryPoint,
    PipelinePoint,
    RankSnapshot,
    RunSnapshot,
    StepPoint,
)
from .stall import StallWatch, Verdict
from .states import RankState

__all__ = ["MAX_RECORDED", "STRAGGLER_MIN_S", "STRAGGLER_MIN_STEPS", "STRAGGLER_SCORE", "WINDOW",
           "BarState", "Diagnosis", "DimPoint", "MemoryPoint", "PipelinePoint", "RankSnapshot",
           "RunState", "StepPoint", "aggregate"]

#: events kept per run for ``%nbdist timeline`` (older ones are dropped first)
MAX_RECORDED = 200_000
#: collectives outside steps waiting for their peers' reports (older ones are dropped)
_MAX_PENDING_COLLECTIVES = 10_000


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
        :func:`~nbdist.telemetry.stall.stall_threshold`'s.
    """

    def __init__(self, ranks: Iterable[int] = (), history: int = 300,
                 started: Optional[float] = None, stall_after: Optional[float] = None):
        self._history = history
        self._ranks: dict[int, RankFold] = {}
        self._active = 0  # ranks not finished: a step is matched once all of them reported
        for r in ranks:
            self._rank(r)
        # step → reports so far: a RankStep's fields, as a plain tuple
        # step -> rank -> its report; None: the rank did not time the step's communication
        self._pending: dict[int, dict[int, Optional[tuple[float, float, float, int, bool]]]] = {}
        # who was waited for in each of the last WINDOW matched steps, and how many matched
        self._blames: deque[Optional[tuple[int, float, float]]] = deque(maxlen=WINDOW)
        self._nmatched = 0
        self._series: dict[int, StepPoint] = {}
        self._free: dict[tuple[str, int], dict[int, tuple[float, int]]] = {}
        #: rank -> what it sent, as ``(events, pickle)`` of each event or table (see events())
        self.recorded: dict[int, deque[Any]] = {}
        self.dropped = 0
        self._nrecorded = 0
        self._t0: Optional[float] = None
        self._t1: Optional[float] = None
        self._bytes = 0
        self._ncomm = 0
        self._dims: dict[str, list] = {}  # dim -> [ops, calls, bytes, nanoseconds]
        # logged values: name -> step -> rank -> value, and their spread over ranks per step
        self._scalar_at: dict[str, dict[float, dict[int, float]]] = {}
        self._spread: dict[str, dict[float, tuple[float, float, float, float]]] = {}
        self._spread_series: dict[str, tuple[tuple[float, float, float, float], ...]] = {}
        self._spread_dirty: set[tuple[str, float]] = set()
        #: progress, step times and where each rank said it was (the hang doctor's input)
        self.stall = StallWatch(started, stall_after)

    def _rank(self, rank: int) -> RankFold:
        st = self._ranks.get(rank)
        if st is None:
            st = self._ranks[rank] = RankFold(self._history)
            self._active += 1
        return st

    def _stop(self, st: RankFold, state: RankState) -> None:
        if st.state.active:
            self._active -= 1
        st.state = state

    def feed(self, batches: Iterable[Batch]) -> bool:
        """Fold batches in (any order of ranks; per rank in ``seq`` order). True if telemetry."""
        changed = False
        for batch in sorted(batches, key=lambda b: (b["rank"], b["seq"])):
            rank = batch["rank"]
            for event in batch["events"]:
                if event.get("kind") in TELEMETRY:
                    self.apply(rank, event)
                    changed = True
        return changed

    def apply(self, rank: int, e: Event) -> None:
        """Fold one event (or table of events) from ``rank``."""
        kind = e["kind"]
        if kind == TABLE:
            self._table(rank, e)
            return
        st = self._rank(rank)
        if kind == STACK:  # where the rank is: not a timed event, kept apart from the trace
            self.stall.stack(rank, e)
            if st.state == RankState.WAITING:
                st.state = RankState.RUNNING
            return
        if kind != END:
            self._record(rank, e, 1)
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
                acc = accumulator(st.comm, e["step"])
                acc.nbytes += e["bytes"]
                acc.busy = None
                if e["t1"] > e["t0"]:
                    acc.spans += (e["t0"], e["t1"])
                    acc.timed_bytes += e["bytes"]
                if e.get("measured") == "untimed":
                    acc.untimed = True
            else:
                self._free_collective(rank, st, e["op"], e["t0"], e["t1"], e["bytes"])
            if e.get("dim") is not None:
                self._dim(e["dim"], e["op"], e["bytes"], e["t1"] - e["t0"])
        elif kind == STAGE:
            st.stage_s.setdefault(e["op"], deque(maxlen=WINDOW * 8)).append(e["t1"] - e["t0"])
        elif kind == PIPELINE:
            st.pipes.append(e)
        elif kind == PROGRESS:
            if st.bar_id != e["bar"]:
                st.bar_id = e["bar"]
                st.bar_points.clear()
            st.bar = e
            st.bar_points.append((e["t"], e["n"]))
        elif kind == SCALARS:
            for name, x, v in st.log(e["values"], e.get("step")):
                self._scalar(rank, name, x, v)
        elif kind == MEMORY:
            self._memory(st, e)
        elif kind == END:
            self._stop(st, RankState.DONE if e["ok"] else RankState.FAILED)
            st.error = e.get("error")
            self.stall.end(rank, e["t"], e["ok"], st.error)
            self._settle_all()  # steps this rank will never report no longer wait for it

    @staticmethod
    def _memory(st: RankFold, e: Event) -> None:
        if st.memory is None or e["params"] or e["grads"] or e["optimizer"]:
            # A cell's last sample comes after its locals are gone: keep what the rank
            # held while it trained.
            st.memory = e
            st.memory_point = None

    def _scalar(self, rank: int, name: str, x: float, v: float) -> None:
        """Keep the value for the spread over ranks at step ``x`` (the chart above a few
        ranks), recomputed at the next snapshot for that step only."""
        at = self._scalar_at.setdefault(name, {})
        col = at.get(x)
        if col is None:
            col = at[x] = {}
            if len(at) > self._history:
                oldest = min(at)
                del at[oldest]
                self._spread.get(name, {}).pop(oldest, None)
        col[rank] = v
        self._spread_dirty.add((name, x))

    def _scalar_spread(self) -> dict[str, tuple[tuple[float, float, float, float], ...]]:
        changed = set()
        for name, x in self._spread_dirty:
            col = self._scalar_at[name].get(x)
            if col is not None:
                vals = sorted(col.values())
                self._spread.setdefault(name, {})[x] = (x, vals[0], statistics.median(vals),
                                                        vals[-1])
                changed.add(name)
        self._spread_dirty.clear()
        for name in changed:
            by_x = self._spread[name]
            self._spread_series[name] = tuple(by_x[x] for x in sorted(by_x))
        return dict(self._spread_series)

    def _span(self, t0: float, t1: float) -> None:
        self._t0 = t0 if self._t0 is None else min(self._t0, t0)
        self._t1 = t1 if self._t1 is None else max(self._t1, t1)

    def _dim(self, dim: str, op: str, nbytes: int, seconds: float) -> None:
        d = self._dims.setdefault(dim, [set(), 0, 0, 0])
        d[0].add(op)
        d[1] += 1
        d[2] += nbytes
        d[3] += to_ns(seconds)

    def _record(self, rank: int, e: Event, n: int) -> None:
        """Keep ``e`` (``n`` events) for the trace, as its pickle: bytes the garbage collector
        never scans. At a thousand ranks, the events kept as dicts (and tables as dicts of
        lists) would make its full collections the notebook's largest cost."""
        rec = self.recorded.setdefault(rank, deque())
        if e["kind"] == TABLE:  # its rows, not the summaries the fold read
            e = {"kind": TABLE, "order": e["order"],
                 "parts": [{"of": p["of"], "fields": p["fields"], "columns": p["columns"]}
                           for p in e["parts"]]}
        rec.append((n, pickle.dumps(e, pickle.HIGHEST_PROTOCOL)))
        self._nrecorded += n
        while self._nrecorded > MAX_RECORDED and rec:
            k = rec.popleft()[0]
            self._nrecorded -= k
            self.dropped += k

    # ------------------------------------------------------------- tables, column by column
    def _table(self, rank: int, t: Event) -> None:
        """Fold a table: what one event at a time would do, with the hot loops on columns.

        A table's collectives are folded before its steps (a step looks up its collectives
        when it lands, and a worker sends a step's collectives before the step).
        """
        st = self._rank(rank)
        self._record(rank, t, table_rows(t))
        if st.state == RankState.WAITING:
            st.state = RankState.RUNNING
        for part in sorted(t["parts"], key=lambda p: p["of"] != COMM):
            kind = part["of"]
            if kind == COMM and "steps" in part:
                self._comm_summary(rank, st, part)
                continue
            if kind == STEP:
                self._step_columns(rank, st, part)
                continue
            if kind == MEMORY:
                self._memory_columns(st, part)
                continue
            cols = columns(part)
            if kind == COMM:
                self._comm_columns(rank, st, cols)
            else:  # rarer kinds: one event at a time
                for e in _part_rows(kind, cols):
                    self._fold(rank, st, e)

    def _memory_columns(self, st: RankFold, part: Event) -> None:
        """What :meth:`_memory` would keep of the part's samples, one at a time: the last one
        that holds anything, else the first when the rank had none."""
        ts = column(part, "t")
        self._span(min(ts), max(ts))
        held = [any(x) for x in zip(column(part, "params"), column(part, "grads"),
                                    column(part, "optimizer"))]
        keep = max((i for i, h in enumerate(held) if h), default=None)
        if keep is None and st.memory is None:
            keep = 0
        if keep is not None:
            st.memory = row(part, keep)
            st.memory_point = None

    def _comm_summary(self, rank: int, st: RankFold, part: Event) -> None:
        """Collectives of steps, from what the worker summed of them (see :mod:`.columns`)."""
        self._span(part["t0"], part["t1"])
        if self.stall.interrupted(rank):  # only what came before the interrupt is progress
            self.stall.progress_all(column(part, "t1"), rank)
        else:
            self.stall.progress(part["t1"], rank)
        self._bytes += part["bytes"]
        self._ncomm += part["n"]
        comm = st.comm
        steps = summary_column(part, "step")
        if any(s in comm for s in steps):  # a step whose collectives came in two batches
            for s, nbytes, timed_bytes, untimed, _, spans in summary(part):
                acc = accumulator(comm, s)
                acc.busy = None
                acc.nbytes += nbytes
                acc.timed_bytes += timed_bytes
                if untimed:
                    acc.untimed = True
                acc.spans += [x for span in spans for x in span]
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
        comm = st.comm
        for i, (s, a, z, b, m) in enumerate(zip(steps, t0s, t1s, nbytes, measured)):
            if s is None:
                self._free_collective(rank, st, cols["op"][i], a, z, b)
                continue
            acc = accumulator(comm, s)
            acc.nbytes += b
            acc.busy = None
            if z > a:
                acc.spans += (a, z)
                acc.timed_bytes += b
            if m == "untimed":
                acc.untimed = True
        dims = cols.get("dim")
        if dims is not None:
            for i, d in enumerate(dims):
                if d is not None:
                    self._dim(d, cols["op"][i], nbytes[i], t1s[i] - t0s[i])

    def _step_columns(self, rank: int, st: RankFold, part: Event) -> None:
        t0s, t1s = column(part, "t0"), column(part, "t1")  # the columns the fold reads
        self._span(min(t0s), max(t1s))
        self.stall.progress_all(t1s, rank)
        lengths = [b - a for a, b in zip(t0s, t1s)]
        self.stall.steps_all(lengths, t1s, rank)
        untimed = None
        if "comm_timed" in part["fields"]:
            flags = column(part, "comm_timed")
            if not all(flags):
                untimed = list(zip(flags, column(part, "comm_bytes")))
        self._steps(rank, st, column(part, "step"), t0s, t1s, lengths,
                    column(part, "samples"), column(part, "comm_exposed_s"), untimed)

    # ------------------------------------------------------------- matching across ranks
    def _steps(self, rank: int, st: RankFold, ns: Sequence[int], t0s: Sequence[float],
               t1s: Sequence[float], lengths: Sequence[float], samples: Sequence[int],
               exposed: Sequence[float],
               timing: Optional[Sequence[tuple[bool, int]]] = None) -> None:
        """Steps ``ns`` of ``rank``, in order: its window, and each step's report, matched
        across ranks once the last one arrives.

        ``timing``, where some step's communication went untimed: per step, whether it was
        timed and its gradient bytes. An untimed step counts its bytes and its length, but
        neither its exposed communication (unknown, not 0) nor a report to match."""
        exposed = [e if e < s else s for e, s in zip(exposed, lengths)]  # min(), inline
        st.steps += len(ns)
        st.t0s.extend(t0s)
        st.t1 = t1s[-1]
        st.step_s.extend(lengths)
        st.samples.extend(samples)
        st.exposed.extend(exposed if timing is None else
                          [e for e, (ok, _) in zip(exposed, timing) if ok])
        comm, pending = st.comm, self._pending
        for i, (n, step_s, ex) in enumerate(zip(ns, lengths, exposed)):
            acc = comm.pop(n, None)
            # A report is a plain tuple of numbers until the step is matched: the garbage
            # collector stops tracking it at once (reports wait for the last rank's, seconds
            # at scale).
            if timing is not None and not timing[i][0]:
                nbytes = timing[i][1] + (0 if acc is None else
                                         acc[0] if type(acc) is tuple else acc.nbytes)
                st.step_bytes.append(nbytes)
                self._bytes += timing[i][1]
                report = None  # reported, untimed: the step is not split (see _settle)
            elif acc is None:
                st.step_bytes.append(0)
                report = (step_s, ex, 0.0, 0, True)
            elif type(acc) is tuple:  # one worker's summary: bytes, timed, untimed, busy
                st.step_bytes.append(acc[0])
                report = (step_s, ex, acc[3], acc[1], not acc[2])
            else:
                st.step_bytes.append(acc.nbytes)
                busy = acc.busy if acc.busy is not None else union_seconds(
                    zip(acc.spans[::2], acc.spans[1::2]))
                report = (step_s, ex, busy, acc.timed_bytes, not acc.untimed)
            reports = pending.get(n)
            if reports is None:
                reports = pending[n] = {}
            reports[rank] = report
            while len(pending) > self._history:  # a rank stopped reporting: give up on it
                del pending[min(pending)]
            # Not given up already (a rank far behind, async), and maybe the last report
            # (fewer reports than ranks still running cannot be all of them).
            if len(reports) >= self._active and n in pending:
                self._settle(n)

    def _waiting_on(self, reporters: Mapping[int, Any]) -> bool:
        """True while a rank that has not reported may still report (it has not ended)."""
        if len(reporters) < self._active:
            return True  # not every rank still running can be among them: no need to look
        if self._active == len(self._ranks):
            return False  # no rank has ended: as many reporters as ranks are all of them
        return any(st.state.active and r not in reporters for r, st in self._ranks.items())

    def _settle(self, step: int) -> None:
        reports = self._pending[step]
        if self._waiting_on(reports):
            return
        del self._pending[step]
        if None in reports.values():
            return  # a rank did not time this step's communication: nothing to split
        m = match_step(step, reports)
        self._blames.append(blame(m))
        index = self._nmatched
        self._nmatched += 1
        bws = []
        tt = m.transfer_time_s
        waiting, transfer = m.waiting, m.transfer_s
        for r, rep in reports.items():
            st = self._ranks[r]
            bw = rep[3] / tt if rep[3] and tt else None  # m.bandwidth(r), inline
            if bw is not None:
                bws.append(bw)
            st.m_index.append(index)
            st.m_waiting.append(waiting[r])
            st.m_transfer.append(transfer)
            st.m_bw.append(bw)
        reps = list(reports.values())
        k = len(reps)
        # fsum: the same whatever order the ranks' reports came in
        self._series[step] = StepPoint(
            step, fsum(p[0] for p in reps) / k, fsum(max(0.0, p[0] - p[1]) for p in reps) / k,
            fsum(waiting.values()) / k, transfer, sum(p[3] for p in reps) // k,
            statistics.median(bws) if bws else None, k, m.last)
        while len(self._series) > self._history:
            del self._series[min(self._series)]

    def _free_collective(self, rank: int, st: RankFold, op: str, t0: float, t1: float,
                         nbytes: int) -> None:
        # Collectives run in the same order on every rank of a group: the k-th call of an op
        # on one rank is the k-th call of that op on the others.
        k = st.free_seq.get(op, 0)
        st.free_seq[op] = k + 1
        if t1 <= t0:
            return  # untimed
        key = (op, k)
        self._free.setdefault(key, {})[rank] = (t1 - t0, nbytes)
        while len(self._free) > _MAX_PENDING_COLLECTIVES:
            del self._free[next(iter(self._free))]
        self._settle_free(key)

    def _settle_free(self, key: tuple[str, int]) -> None:
        reports = self._free[key]
        if self._waiting_on(reports):
            return
        del self._free[key]
        m = MatchedCollective(key[0], {r: v[0] for r, v in reports.items()},
                              {r: v[1] for r, v in reports.items()})
        for r in reports:
            st = self._ranks[r]
            st.free += 1
            st.free_waiting_ns += to_ns(m.waiting(r))
            st.free_transfer_ns += to_ns(m.transfer_s)
            bw = m.bandwidth(r)
            if bw is not None:
                st.free_bw.append(bw)

    def _settle_all(self) -> None:
        for step in sorted(self._pending):
            self._settle(step)
        for key in list(self._free):
            self._settle_free(key)

    def finish(self) -> None:
        """The run is over: ranks that never said they finished are marked stopped."""
        for st in self._ranks.values():
            if st.state.active:
                self._stop(st, RankState.STOPPED)
                st.error = st.error or "no end-of-cell report (interrupted, or the worker died)"
        self._settle_all()

    # ------------------------------------------------------------- snapshot
    def snapshot(self, now: Optional[float] = None, at: Optional[float] = None) -> RunSnapshot:
        """The current summary; ``now`` (worker clock) makes progress ETAs count down, ``at``
        (the notebook's ``time.time()``) is when a stall is judged (None: not judged)."""
        ranks = sorted(self._ranks)
        scores = scores_of(list(self._blames), ranks)
        slow = flagged(scores, len(self._blames))
        flagged_set = set(slow)
        cutoff = self._nmatched - WINDOW  # match numbers of the run's last WINDOW matches
        numbers = [figures(self._ranks[r], cutoff) for r in ranks]
        known = sorted(f[3] for f in numbers if f[3] is not None)  # compute per step
        out = []
        for r, f in zip(ranks, numbers):
            c = f[3]
            others = median_without(known, c) if c is not None else None
            out.append(rank_snapshot(r, self._ranks[r], f, now, r in flagged_set,
                                     scores[r].score, c - others if others is not None else None))
        elapsed = (self._t1 - self._t0) if self._t0 is not None and self._t1 is not None else 0.0
        curves: dict[str, dict[int, tuple[tuple[float, float], ...]]] = {}
        for r in ranks:
            st = self._ranks[r]
            for name, pts in st.scalar_points.items():
                curve = st.scalar_curves.get(name)
                if curve is None:
                    curve = st.scalar_curves[name] = tuple(pts)
                curves.setdefault(name, {})[r] = curve
        dims = tuple(DimPoint(dim, tuple(sorted(d[0])), d[1], d[2], d[3] / 1e9)
                     for dim, d in sorted(self._dims.items()))
        stall = self.verdict(at) if at is not None else None
        return RunSnapshot(tuple(out), tuple(self._series[s] for s in sorted(self._series)),
                           tuple(slow), elapsed, self._bytes, self._ncomm, curves, dims=dims,
                           stall=stall, scalar_spread=self._scalar_spread())

    def _states(self) -> dict[int, RankState]:
        return {r: st.state for r, st in self._ranks.items()}

    def verdict(self, at: float) -> Optional[Verdict]:
        """The hang doctor's verdict at ``at`` (None: no stall past the threshold)."""
        threshold = self.stall.threshold
        if threshold is None or self.stall.idle(at) < threshold:
            return None  # the usual answer, asked ten times a second: no states to gather
        return self.stall.verdict(self._ranks, self._states(), at)

    def where(self, at: float) -> Optional[Verdict]:
        """Where each rank was by its last report, threshold or not (for the error a timeout
        or an interrupt raises); None when no rank reported where it was."""
        return self.stall.where(self._ranks, self._states(), at)

    def events(self) -> dict[int, list[Event]]:
        """The recorded telemetry events per rank (for a trace file), tables expanded."""
        out = {}
        for r, kept in self.recorded.items():
            evs = [pickle.loads(blob) for _, blob in kept]
            out[r] = [x for e in evs for x in (rows(e) if e["kind"] == TABLE else (e,))]
        return out


def _part_rows(kind: str, cols: dict[str, list[Any]]) -> Iterable[Event]:
    fields = list(cols)
    for values in zip(*cols.values()):
        e = {"kind": kind}
        e.update(zip(fields, values))
        yield e


def aggregate(batches: Iterable[Batch], ranks: Iterable[int] = ()) -> RunSnapshot:
    """Fold ``batches`` at once (tests, and summaries of a finished run)."""
    batches = list(batches)
    # every rank that sent anything is expected: steps are split once all of them reported
    state = RunState(sorted(set(ranks) | {b["rank"] for b in batches}))
    state.feed(batches)
    return state.snapshot()
