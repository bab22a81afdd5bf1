"""One rank's part of a run's fold, and what a snapshot reads of it.

A :class:`RankFold` holds a rank's recent steps, the matched steps it took part in and its
collectives waiting for their step; it turns its steps into the reports that
:class:`~.matching.StepMatcher` matches across ranks. :func:`figures` and :func:`rank_snapshot`
turn it into the rank's row. Pure, like the fold (:mod:`.aggregate`) that owns them.
"""

from __future__ import annotations

import statistics
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Sequence
from math import fsum
from typing import Any, Optional

from .columns import column, numbers, row, summary
from .events import Event
from .intervals import bubble_fraction, rate, union_seconds
from .snapshot import (
    WINDOW,
    BarState,
    MemoryPoint,
    ModelMemory,
    ModelPoint,
    PipelinePoint,
    RankSnapshot,
    TrialPoint,
)
from .states import RankState

__all__ = ["LAG_S", "RankFold", "Report", "StepComm", "accumulator", "common_moment", "figures",
           "mean", "median_without", "models_and_trial", "pipeline_point", "rank_snapshot", "to_ns"]

#: a running rank whose latest report is this much older than the newest rank's is shown as
#: of its own report ("as of"); the others are read at one moment (see :func:`common_moment`)
LAG_S = 2.0
#: bars kept open per rank (nested loops: an epoch bar around a batch bar)
MAX_BARS = 4

#: one rank's report of one step, a :class:`~.matching.RankStep`'s fields as a plain tuple (the
#: garbage collector stops tracking it at once; reports wait for the last rank's, seconds at
#: scale); None: the rank did not time the step's communication
Report = Optional[tuple[float, float, float, int, bool]]


class StepComm:
    """One rank's collectives of one step, until the step's own report lands (when one
    worker's summary told all of them, the fold keeps what it told instead: see
    :meth:`~.aggregate.RunState._comm_summary`)."""

    __slots__ = ("spans", "nbytes", "timed_bytes", "untimed", "busy")

    def __init__(self) -> None:
        self.spans: list[float] = []  # of the timed ones: start, end, start, end...
        self.nbytes = 0
        self.timed_bytes = 0
        self.untimed = False  # one of them had no time (a GPU bucket not completed yet)
        #: the union of the spans' time, when one worker's summary told all of it
        self.busy: Optional[float] = None

    @classmethod
    def of(cls, told: tuple) -> StepComm:
        """From what a worker's summary told of a step: ``(bytes, timed bytes, untimed,
        busy, part, row)`` (:func:`~.columns.summary` of the part has its intervals)."""
        acc = cls()
        acc.nbytes, acc.timed_bytes, acc.untimed, acc.busy, part, i = told
        acc.spans = [x for span in summary(part)[i][5] for x in span]
        return acc


class RankFold:
    """One rank's running state in a run's fold (:class:`~.aggregate.RunState`)."""

    def __init__(self, history: int) -> None:
        self.state = RankState.WAITING
        self.error: Optional[str] = None
        self.steps = 0
        # its last WINDOW steps: start, length, samples; exposed (at most the length) of its
        # last WINDOW steps whose communication was timed
        self.t0s: deque[float] = deque(maxlen=WINDOW)
        self.t1 = 0.0  # the end of its latest step
        self.step_s: deque[float] = deque(maxlen=WINDOW)
        self.samples: deque[int] = deque(maxlen=WINDOW)
        self.exposed: deque[float] = deque(maxlen=WINDOW)
        # step → its collectives until the step lands: a StepComm, or a worker's summary
        self.comm: dict[int, Any] = {}
        # the matched steps it took part in: the run's match number, its waiting, the
        # step's transfer, its bandwidth (None: no bytes)
        self.m_index: deque[int] = deque(maxlen=WINDOW)
        self.m_waiting: deque[float] = deque(maxlen=WINDOW)
        self.m_transfer: deque[float] = deque(maxlen=WINDOW)
        self.m_bw: deque[Optional[float]] = deque(maxlen=WINDOW)
        self.bar_id: Optional[int] = None
        self.bar: Optional[Event] = None  # the bar its row shows: the innermost open one
        self.bars: dict[int, Event] = {}  # open bars by id (an inner bar is made later)
        self.bar_points: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self.scalars: dict[str, float] = {}
        self.history = history
        # name -> (step, value) points, the last ``history``; and their tuple, until a new
        # one arrives (a snapshot at a thousand ranks must not copy every curve every time)
        self.scalar_points: dict[str, list[tuple[float, float]]] = {}
        self.scalar_curves: dict[str, tuple[tuple[float, float], ...]] = {}
        self.free_seq: dict[str, int] = {}  # op → collectives outside steps seen so far
        self.free = 0
        # nanoseconds: integers add up the same in any order (ranks' reports interleave
        # differently from one feed to the next; the sums must not)
        self.free_waiting_ns = 0
        self.free_transfer_ns = 0
        self.free_bw: deque[float] = deque(maxlen=WINDOW)
        self.memory: Optional[Event] = None
        self.memory_point: Optional[MemoryPoint] = None  # of ``memory``, once asked for
        self.scalars_copy: Optional[dict[str, float]] = None  # of ``scalars``, likewise
        self.step_bytes: deque[int] = deque(maxlen=WINDOW)
        self.pipes: deque[Event] = deque(maxlen=WINDOW)  # schedule steps
        self.stage_s: dict[str, deque[float]] = {}  # "forward"/"backward" -> per microbatch
        #: the job's step its step 0 is (a replacement worker counts from 0 in its process)
        self.offset = 0
        self.last_step: Optional[int] = None  # the job's index of its latest step
        #: its first reports went elsewhere (a job watched by a notebook that restarted):
        #: the first step it reports here says how many it took before
        self.counts_from_index = False
        self.joined_at: Optional[int] = None  # a replacement: the job's step it joined at
        self.replaced = False  # a worker a replacement took the place of
        self.models: dict[int, Event] = {}  # DDP model number -> what it runs with, latest
        self.trial: Optional[Event] = None  # a tuning trial's end on this rank

    def add_collective(self, step: int, t0: float, t1: float, nbytes: int,
                       untimed: bool = False) -> None:
        """One collective of ``step``: timed where ``t1 > t0``; ``untimed``, the worker says it
        had no time yet (a GPU bucket), which its step's report then says too."""
        if t1 > t0:
            self.add_collectives(step, nbytes, nbytes, untimed, (t0, t1))
        else:
            self.add_collectives(step, nbytes, 0, untimed, ())

    def add_collectives(self, step: int, nbytes: int, timed_bytes: int, untimed: bool,
                        spans: Sequence[float]) -> None:
        """Collectives of ``step`` (one, or what a worker summed of several): their bytes, the
        timed ones' bytes and intervals (flat: start, end, start, end...), and whether one of
        them had no time. Kept until the step's own report lands (:meth:`add_steps`)."""
        acc = accumulator(self.comm, step)
        acc.nbytes += nbytes
        acc.timed_bytes += timed_bytes
        acc.spans += spans
        if untimed:
            acc.untimed = True
        acc.busy = None  # the spans' union, worked out again when the step lands

    def add_steps(self, ns: Sequence[int], t0s: Sequence[float], t1s: Sequence[float],
                  lengths: Sequence[float], samples: Sequence[int], exposed: Sequence[float],
                  timing: Optional[Sequence[tuple[bool, int]]] = None
                  ) -> tuple[list[Report], int]:
        """Steps ``ns``, in order, into the rank's window; returns each step's report, with
        its collectives so far, and the bytes of the steps whose communication went untimed.

        ``timing``, where some step's communication went untimed: per step, whether it was
        timed and its gradient bytes. An untimed step counts its bytes and its length, but
        neither its exposed communication (unknown, not 0) nor a report to match."""
        exposed = [e if e < s else s for e, s in zip(exposed, lengths)]  # min(), inline
        self._window(ns, t0s, t1s, lengths, samples)
        self.exposed.extend(exposed if timing is None else
                            [e for e, (ok, _) in zip(exposed, timing) if ok])
        comm, step_bytes = self.comm, self.step_bytes
        reports: list[Report] = []
        untimed_bytes = 0
        for i, (n, step_s, ex) in enumerate(zip(ns, lengths, exposed)):
            acc = comm.pop(n, None)
            if timing is not None and not timing[i][0]:
                step_bytes.append(timing[i][1] + (0 if acc is None else
                                                  acc[0] if type(acc) is tuple else acc.nbytes))
                untimed_bytes += timing[i][1]
                reports.append(None)  # reported, untimed: the step is not split
            elif acc is None:
                step_bytes.append(0)
                reports.append((step_s, ex, 0.0, 0, True))
            elif type(acc) is tuple:  # one worker's summary: bytes, timed, untimed, busy
                step_bytes.append(acc[0])
                reports.append((step_s, ex, acc[3], acc[1], not acc[2]))
            else:
                step_bytes.append(acc.nbytes)
                busy = acc.busy if acc.busy is not None else union_seconds(
                    zip(acc.spans[::2], acc.spans[1::2]))
                reports.append((step_s, ex, busy, acc.timed_bytes, not acc.untimed))
        return reports, untimed_bytes

    def _window(self, ns: Sequence[int], t0s: Sequence[float], t1s: Sequence[float],
                lengths: Sequence[float], samples: Sequence[int]) -> None:
        """Steps ``ns`` counted, their times and samples into the window (its last
        :data:`WINDOW` steps are all it keeps)."""
        w = -WINDOW
        if self.counts_from_index:  # step n is its (n+1)-th: n came before, unseen here
            self.counts_from_index = False
            self.steps += max(0, ns[0] - self.steps)
        self.steps += len(ns)
        self.last_step = ns[-1] + self.offset
        self.t0s.extend(t0s[w:])
        self.t1 = t1s[-1]
        self.step_s.extend(lengths[w:])
        self.samples.extend(samples[w:])

    def add_summed_steps(self, ns: Sequence[int], t0s: Sequence[float], t1s: Sequence[float],
                         tail: tuple[list[float], list[float]], lengths: Sequence[float],
                         samples: Sequence[int], exposed: Sequence[float],
                         told: Sequence[Sequence[Any]], keep: Iterable[int]) -> list[Report]:
        """:meth:`add_steps` for steps whose collectives, all timed, one worker's summary told
        (``told``: its ``bytes``, ``timed``, ``untimed`` and ``busy`` columns, a value per
        step), none of them kept waiting in :attr:`comm`: the window takes only the last
        :data:`WINDOW` steps (``tail``: at least their starts and ends; ``lengths``: theirs),
        and reports are made only for the steps at indices ``keep`` (the ones matched across
        ranks). Returns those reports.

        The same window and reports as :meth:`add_steps` after
        :meth:`~.aggregate.RunState._comm_summary`, at a cost per matched step rather than
        per step (at a thousand ranks, most of a batch's steps are in neither): the columns
        may be views (:func:`~.columns.numbers`), of which only those steps are read."""
        nbytes, timed, untimed, busy = told
        w = -WINDOW
        self._window(ns, tail[0], tail[1], lengths, samples)
        self.exposed.extend([e if e < s else s for e, s in zip(list(exposed[w:]), lengths[w:])])
        self.step_bytes.extend(nbytes[w:])
        out: list[Report] = []
        for i in keep:
            s, e = t1s[i] - t0s[i], exposed[i]
            out.append((s, e if e < s else s, busy[i], timed[i], not untimed[i]))
        return out

    def memory_columns(self, part: Event) -> tuple[float, float]:
        """What :meth:`~.aggregate.RunState._fold` would keep of a part of memory samples, one
        at a time: the last one that holds anything, else the first when the rank had none.
        Returns the samples' time span."""
        kept = part.get("held", False)  # the worker found it (False: a table made without)
        if kept:  # as a rule: that sample, already a dict; nothing to decode
            self.memory, self.memory_point = kept, None
            return part["t0"], part["t1"]
        ts = numbers(part, "t")
        keep: Optional[int] = None
        if kept is False:
            held = [any(x) for x in zip(column(part, "params"), column(part, "grads"),
                                        column(part, "optimizer"))]
            keep = max((i for i, h in enumerate(held) if h), default=None)
        if keep is None and self.memory is None:
            keep = 0
        if keep is not None:
            self.memory = row(part, keep)
            self.memory_point = None
        return (part["t0"], part["t1"]) if "t1" in part else (min(ts), max(ts))

    def job_steps(self, ns: Sequence[int]) -> Sequence[int]:
        """Its step numbers ``ns`` as the job's (the ones the ranks' reports match by)."""
        off = self.offset
        return [n + off for n in ns] if off else ns

    def progress(self, e: Event) -> None:
        """A bar moved. The row shows the innermost bar still open (the latest made), so an
        epoch bar around a batch bar does not take the row each time it moves."""
        bars = self.bars
        if e["done"]:
            bars.pop(e["bar"], None)
        else:
            bars[e["bar"]] = e
            while len(bars) > MAX_BARS:
                del bars[min(bars)]
        shown = bars[max(bars)] if bars else e
        if shown is not e and self.bar is not None and shown["bar"] == self.bar_id:
            return  # a bar around the one shown moved
        if self.bar_id != shown["bar"]:
            self.bar_id = shown["bar"]
            self.bar_points.clear()
        self.bar = shown
        if shown is e:
            self.bar_points.append((e["t"], e["n"]))

    def latest(self) -> Optional[float]:
        """When it last reported progress: its bar's latest move, else its latest step."""
        if self.bar is not None:
            return self.bar["t"]
        return self.t1 if self.steps else None

    def log(self, logged: Sequence[Event]) -> list[tuple[str, float, float]]:
        """Take logged values (``scalars`` events, in order); returns each as
        ``(name, step, value)``."""
        off, points, scalars, history = self.offset, self.scalar_points, self.scalars, self.history
        out = []
        for e in logged:
            values, step = e["values"], e.get("step")
            if step is not None:
                step += off
            scalars.update(values)
            for k, v in values.items():
                pts = points.get(k)
                if pts is None:
                    pts = points[k] = []
                x = float(step) if step is not None else (pts[-1][0] + 1 if pts else 0.0)
                pts.append((x, v))
                out.append((k, x, v))
        self.scalars_copy = None
        for k in {k for k, _, _ in out}:
            pts = points[k]
            if len(pts) > history:
                del pts[:len(pts) - history]
            self.scalar_curves.pop(k, None)
        return out

    def log_columns(self, names: Sequence[str], steps: Sequence[Optional[int]],
                    values: Sequence[Sequence[float]]
                    ) -> list[tuple[str, list[float], Sequence[float]]]:
        """:meth:`log` for logged values as columns (:func:`~.columns.logged`): ``names``,
        the ``steps`` they were logged at and a column of ``values`` per name. Returns
        ``(name, steps, values)`` per name, the steps as the run's (floats)."""
        off, points, history = self.offset, self.scalar_points, self.history
        out = []
        numbered = None not in steps
        for k, vs in zip(names, values):
            pts = points.get(k)
            if pts is None:
                pts = points[k] = []
            if numbered:  # as a rule
                xs = list(map(float, steps)) if not off else [float(s + off) for s in steps]
            else:  # a value logged without a step goes one after the name's last
                xs, last = [], pts[-1][0] if pts else None
                for s in steps:
                    last = float(s + off) if s is not None else (
                        last + 1 if last is not None else 0.0)
                    xs.append(last)
            pts.extend(zip(xs, vs))
            if len(pts) > history:
                del pts[:len(pts) - history]
            self.scalars[k] = vs[-1]
            self.scalar_curves.pop(k, None)
            out.append((k, xs, vs))
        self.scalars_copy = None
        return out


def common_moment(folds: Iterable[RankFold]) -> Optional[float]:
    """The moment running ranks' counts are read at, so that none looks ahead of another by
    reporting later: the oldest latest report among them, leaving out ranks more than
    :data:`LAG_S` behind the newest (those are shown as of their own report)."""
    times = [t for st in folds if st.state.active and (t := st.latest()) is not None]
    if not times:
        return None
    newest = max(times)
    return min(t for t in times if t >= newest - LAG_S)


def _at(st: RankFold, moment: Optional[float]) -> tuple[int, Optional[int], Optional[float]]:
    """Its steps, its bar's position, and how far its latest report is behind ``moment``
    (None: it is read at the moment), with what it reported after ``moment`` left out."""
    latest = st.latest() if st.state.active else None
    bar_n = st.bar["n"] if st.bar is not None else None
    if moment is None or latest is None:
        return st.steps, bar_n, None
    if latest < moment:
        return st.steps, bar_n, moment - latest
    later = sum(1 for a, s in zip(st.t0s, st.step_s) if a + s > moment)
    if st.bar is not None:
        before = [n for t, n in st.bar_points if t <= moment]
        bar_n = before[-1] if before else (st.bar_points[0][1] if st.bar_points else bar_n)
    return st.steps - later, bar_n, None


def rank_snapshot(r: int, st: RankFold, numbers: tuple, now: Optional[float], straggler: bool,
                  score: float, gap: Optional[float], moment: Optional[float] = None
                  ) -> RankSnapshot:
    """What a snapshot shows of rank ``r``: its :func:`figures` (``numbers``), its bar, memory
    and logged values, and what the run says of it (straggler, score, compute above the
    others'); counts as of ``moment`` (:func:`common_moment`)."""
    sps, smp, step_s, compute, exposed, waiting, transfer, bw = numbers
    steps, bar_n, behind = _at(st, moment)
    bar = None
    if st.bar is not None:
        b = st.bar
        rt = rate(list(st.bar_points))
        eta = None
        if rt and b["total"] is not None and not b["done"] and st.state.active:
            eta = (b["total"] - b["n"]) / rt
            if now is not None:  # count down between progress reports
                eta = max(0.0, eta - max(0.0, now - b["t"]))
        outer = tuple(_bar_label(o) for i, o in sorted(st.bars.items()) if i < b["bar"])
        bar = BarState(b["desc"], bar_n if bar_n is not None else b["n"], b["total"], rt, eta,
                       b["done"], outer)
    # Records that did not change are the same objects from one snapshot to the next:
    # less to build, and less for the garbage collector to follow.
    mem = st.memory_point
    if mem is None and st.memory is not None:
        m = st.memory
        model = m.get("model")
        mem = st.memory_point = MemoryPoint(m["params"], m["grads"], m["optimizer"],
                                            m.get("rss"), m.get("peak"),
                                            m.get("device_peak"),
                                            ModelMemory(**model) if model else None)
    if st.scalars_copy is None:
        st.scalars_copy = dict(st.scalars)
    last = st.last_step - (st.steps - steps) if st.last_step is not None else None
    return RankSnapshot(
        r, st.state, st.error, steps, sps, smp, step_s, compute, exposed, waiting,
        transfer, bw, bar, st.scalars_copy, straggler, score, gap, st.free,
        st.free_waiting_ns / 1e9, st.free_transfer_ns / 1e9, memory=mem,
        bytes_per_step=mean(st.step_bytes), pipeline=pipeline_point(st), last_step=last,
        joined_at=st.joined_at, replaced=st.replaced, behind_s=behind)


def _bar_label(e: Event) -> str:
    """``epoch 2/3``: a bar around the one a row shows."""
    total = f"/{e['total']}" if e["total"] is not None else ""
    return f"{e['desc'] or 'bar'} {e['n']}{total}"


def figures(st: RankFold, cutoff: int) -> tuple:
    """A rank's rates and means over its recent steps and matched steps: steps/s, samples/s,
    step, compute, exposed, waiting, transfer (seconds) and bandwidth (``cutoff``: the match
    number of the run's oldest match in the window)."""
    n = len(st.step_s)
    sps = smp = step_s = exposed = compute = None
    if n:
        span = st.t1 - st.t0s[0]
        if span > 0:
            sps = n / span
            smp = sum(st.samples) / span
        step_s = fsum(st.step_s) / n
        # Over the steps whose communication was timed (a sample of short DDP steps).
        if st.exposed:
            exposed = fsum(st.exposed) / len(st.exposed)
            compute = step_s - exposed
    waits: Sequence[float] = st.m_waiting
    transfers: Sequence[float] = st.m_transfer
    bws_all: Sequence[Optional[float]] = st.m_bw
    if st.m_index and st.m_index[0] < cutoff:  # some are older than the run's window
        keep = [i for i, g in enumerate(st.m_index) if g >= cutoff]
        waits = [st.m_waiting[i] for i in keep]
        transfers = [st.m_transfer[i] for i in keep]
        bws_all = [st.m_bw[i] for i in keep]
    bws = [b for b in bws_all if b is not None] or list(st.free_bw)
    return (sps, smp, step_s, compute, exposed, mean(waits), mean(transfers),
            statistics.median(bws) if bws else None)


def accumulator(comm: dict[int, Any], step: int) -> StepComm:
    """The step's :class:`StepComm` (one made from a worker's summary, or a new one)."""
    acc = comm.get(step)
    if acc is None:
        acc = comm[step] = StepComm()
    elif type(acc) is tuple:
        acc = comm[step] = StepComm.of(acc)
    return acc


def to_ns(seconds: float) -> int:
    return round(seconds * 1e9)


def mean(xs: Sequence[float]) -> Optional[float]:
    """``statistics.fmean`` (an exact sum over the count), without its overhead."""
    return fsum(xs) / len(xs) if xs else None


def median_without(xs: Sequence[float], x: float) -> Optional[float]:
    """The median of sorted ``xs`` less one occurrence of ``x`` (None: nothing else left),
    as ``statistics.median`` computes it, without building the shorter list."""
    i = bisect_left(xs, x)
    n = len(xs) - 1
    if n <= 0:
        return None

    def at(j: int) -> float:
        return xs[j] if j < i else xs[j + 1]

    if n % 2:
        return at(n // 2)
    return (at(n // 2 - 1) + at(n // 2)) / 2


def pipeline_point(st: RankFold) -> Optional[PipelinePoint]:
    """Medians of a rank's recent schedule steps (robust to the first step's shape
    inference and to a noisy machine)."""
    if not st.pipes:
        return None
    last = st.pipes[-1]
    spans = [e["t1"] - e["t0"] for e in st.pipes]
    fwd, bwd = st.stage_s.get("forward"), st.stage_s.get("backward")
    return PipelinePoint(
        tuple(last["stages"]), last["num_stages"], last["schedule"], last["microbatches"],
        statistics.median(bubble_fraction(e["t1"] - e["t0"], e["busy_s"]) for e in st.pipes),
        statistics.median(spans),
        statistics.median(fwd) if fwd else None, statistics.median(bwd) if bwd else None,
        statistics.median(e["p2p_wait_s"] for e in st.pipes))


def models_and_trial(ranks: dict[int, RankFold]
                     ) -> tuple[tuple[ModelPoint, ...], Optional[TrialPoint]]:
    """The lowest rank's DDP models (every rank builds the same), and a trial's end over
    the ranks that reported one."""
    first = next((st.models for _, st in sorted(ranks.items()) if st.models), {})
    models = tuple(ModelPoint(e["params"], e["tensors"], e["bytes"], e["bucket_cap_mb"],
                              e["gradient_as_bucket_view"], e["static_graph"],
                              e["comm_hook"], tuple(e["applied"]), tuple(e["explicit"]))
                   for _, e in sorted(first.items()))
    ends = [st.trial for st in ranks.values() if st.trial is not None]
    trial = TrialPoint(min(e["steps"] for e in ends), ends[0]["budget"],
                       all(e["cut"] for e in ends)) if ends else None
    return models, trial
