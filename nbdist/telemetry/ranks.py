"""One rank's part of a run's fold, and what a snapshot reads of it.

A :class:`RankFold` holds a rank's recent steps, the matched steps it took part in and its
collectives waiting for their step; it turns its steps into the reports that
:class:`~.matcher.StepMatcher` matches across ranks. :func:`figures` and :func:`rank_snapshot`
turn it into the rank's row. Pure, like the fold (:mod:`.aggregate`) that owns them.
"""

from __future__ import annotations

import statistics
from bisect import bisect_left
from collections import deque
from collections.abc import Mapping, Sequence
from math import fsum
from typing import Any, Optional

from .columns import summary
from .events import Event
from .intervals import bubble_fraction, rate, union_seconds
from .snapshot import WINDOW, BarState, MemoryPoint, ModelMemory, PipelinePoint, RankSnapshot
from .states import RankState

__all__ = ["RankFold", "Report", "StepComm", "accumulator", "figures", "mean",
           "median_without", "pipeline_point", "rank_snapshot", "to_ns"]

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
        self.bar: Optional[Event] = None
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
        self.steps += len(ns)
        self.t0s.extend(t0s)
        self.t1 = t1s[-1]
        self.step_s.extend(lengths)
        self.samples.extend(samples)
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

    def log(self, values: Mapping[str, float], step: Optional[int]
            ) -> list[tuple[str, float, float]]:
        """Take logged values; returns each as ``(name, step, value)``."""
        self.scalars.update(values)
        self.scalars_copy = None
        out = []
        for k, v in values.items():
            pts = self.scalar_points.setdefault(k, [])
            x = float(step) if step is not None else (pts[-1][0] + 1 if pts else 0.0)
            pts.append((x, v))
            if len(pts) > self.history:
                del pts[0]
            self.scalar_curves.pop(k, None)
            out.append((k, x, v))
        return out


def rank_snapshot(r: int, st: RankFold, numbers: tuple, now: Optional[float], straggler: bool,
                  score: float, gap: Optional[float]) -> RankSnapshot:
    """What a snapshot shows of rank ``r``: its :func:`figures` (``numbers``), its bar, memory
    and logged values, and what the run says of it (straggler, score, compute above the
    others')."""
    sps, smp, step_s, compute, exposed, waiting, transfer, bw = numbers
    bar = None
    if st.bar is not None:
        b = st.bar
        rt = rate(list(st.bar_points))
        eta = None
        if rt and b["total"] is not None and not b["done"]:
            eta = (b["total"] - b["n"]) / rt
            if now is not None:  # count down between progress reports
                eta = max(0.0, eta - max(0.0, now - b["t"]))
        bar = BarState(b["desc"], b["n"], b["total"], rt, eta, b["done"])
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
    return RankSnapshot(
        r, st.state, st.error, st.steps, sps, smp, step_s, compute, exposed, waiting,
        transfer, bw, bar, st.scalars_copy, straggler, score, gap, st.free,
        st.free_waiting_ns / 1e9, st.free_transfer_ns / 1e9, memory=mem,
        bytes_per_step=mean(st.step_bytes), pipeline=pipeline_point(st))


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
