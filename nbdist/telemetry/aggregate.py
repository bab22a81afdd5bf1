"""Fold telemetry events into a :class:`RunSnapshot`: the numbers every view draws.

Pure: no IPython, widgets, processes or clocks (callers pass ``now``). The run's record
(:class:`~nbdist.telemetry.run.Run`) calls :meth:`RunState.feed` with the event batches of a
run and :meth:`RunState.snapshot` when a view redraws; everything here is unit-tested on
synthetic event streams. How ranks' reports of one step are matched and split into waiting and
transfer: :mod:`.matching`.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

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
    TELEMETRY,
    Batch,
    Event,
)
from .intervals import bubble_fraction, rate, union_seconds
from .matching import (
    STRAGGLER_MIN_S,
    STRAGGLER_MIN_STEPS,
    STRAGGLER_SCORE,
    MatchedCollective,
    MatchedStep,
    RankStep,
    flagged,
    match_step,
    straggler_scores,
)
from .stall import StallWatch, Verdict
from .states import RankState
from .units import fmt_rate

__all__ = ["MAX_RECORDED", "STRAGGLER_MIN_S", "STRAGGLER_MIN_STEPS", "STRAGGLER_SCORE", "WINDOW",
           "BarState", "Diagnosis", "RankSnapshot", "RunSnapshot", "RunState", "StepPoint",
           "aggregate"]

#: steps used for rates, means and straggler scores (recent behaviour, not the whole run's)
WINDOW = 20
#: events kept per run for ``%nbdist timeline`` (older ones are dropped first)
MAX_RECORDED = 200_000
#: collectives outside steps waiting for their peers' reports (older ones are dropped)
_MAX_PENDING_COLLECTIVES = 10_000


# ----------------------------------------------------------------- snapshot records
@dataclass(frozen=True)
class StepPoint:
    """One step every rank has reported, as the mean over those ranks (the charts' x-axis)."""

    step: int
    step_s: float
    compute_s: float
    waiting_s: float  # exposed time spent waiting for the last rank to arrive
    transfer_s: float  # exposed transfer: the exposed time of the last rank to arrive
    nbytes: int
    bandwidth: Optional[float]  # bytes/s: bytes over the step's transfer time, median of ranks
    ranks: int
    waited_for: Optional[int] = None  # the rank the others waited for

    @property
    def exposed_s(self) -> float:
        return self.waiting_s + self.transfer_s


@dataclass(frozen=True)
class BarState:
    desc: str
    n: int
    total: Optional[int]
    rate: Optional[float]  # items/s
    eta_s: Optional[float]
    done: bool

    @property
    def fraction(self) -> Optional[float]:
        return min(1.0, self.n / self.total) if self.total else None


@dataclass(frozen=True)
class MemoryPoint:
    """Bytes one rank held at its latest sample (see ``runtime/measure.py``)."""

    params: int
    grads: int
    optimizer: int
    rss: Optional[int]  # resident memory of the process now
    peak: Optional[int]  # its peak resident memory
    device_peak: Optional[int] = None  # torch.cuda.max_memory_allocated on a GPU

    @property
    def training(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class PipelinePoint:
    """One rank's part of a pipeline over its recent schedule steps (medians)."""

    stages: tuple[int, ...]  # the stage indices this rank runs
    num_stages: int
    schedule: str  # the schedule's class name
    microbatches: int
    bubble: float  # idle fraction of a schedule step: not computing forward or backward
    step_s: float  # one schedule step, call to return
    forward_s: Optional[float]  # one microbatch's forward on this rank's stage
    backward_s: Optional[float]
    p2p_wait_s: float  # per step, blocked on sends and receives

    @property
    def label(self) -> str:
        """``"stage 1/2"`` (or ``"stages 0,2/4"`` for looped schedules)."""
        word = "stage" if len(self.stages) == 1 else "stages"
        return f"{word} {','.join(map(str, self.stages))}/{self.num_stages}"


@dataclass(frozen=True)
class DimPoint:
    """Collectives of one device-mesh dimension, summed over every rank of the run."""

    dim: str
    ops: tuple[str, ...]
    calls: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class RankSnapshot:
    """One rank now. Per-step times are means over its last :data:`WINDOW` steps."""

    rank: int
    state: RankState
    error: Optional[str] = None
    steps: int = 0
    steps_per_s: Optional[float] = None
    samples_per_s: Optional[float] = None
    step_s: Optional[float] = None
    compute_s: Optional[float] = None  # step time less exposed communication
    exposed_s: Optional[float] = None
    waiting_s: Optional[float] = None  # of the exposed time: waiting for the last rank
    transfer_s: Optional[float] = None  # of the exposed time: transfer
    bandwidth: Optional[float] = None  # bytes over transfer time, median of recent steps
    bar: Optional[BarState] = None
    scalars: dict[str, float] = field(default_factory=dict)
    straggler: bool = False
    #: mean share of the other ranks' step spent waiting for this rank (0-1)
    straggler_score: float = 0.0
    #: compute per step above the median of the other ranks' (seconds; negative: faster)
    slower_by_s: Optional[float] = None
    #: collectives called outside any step: how many, and seconds waiting / transferring
    collectives: int = 0
    collective_waiting_s: float = 0.0
    collective_transfer_s: float = 0.0
    memory: Optional[MemoryPoint] = None
    bytes_per_step: Optional[float] = None  # mean payload of a step's collectives (recent)
    pipeline: Optional[PipelinePoint] = None

    @property
    def exposed_fraction(self) -> Optional[float]:
        return _share(self.exposed_s, self.step_s)

    @property
    def waiting_fraction(self) -> Optional[float]:
        return _share(self.waiting_s, self.step_s)

    @property
    def transfer_fraction(self) -> Optional[float]:
        return _share(self.transfer_s, self.step_s)


def _share(part: Optional[float], whole: Optional[float]) -> Optional[float]:
    return min(1.0, part / whole) if part is not None and whole else None


@dataclass(frozen=True)
class Diagnosis:
    """Where a run's time goes, in the numbers a header states."""

    #: the straggler everyone waits for (the flagged rank with the highest score)
    waited_for: Optional[int]
    #: its compute per step, and how much that exceeds the median of the others'
    compute_s: Optional[float]
    slower_by_s: Optional[float]
    #: share of the step spent waiting: by the other ranks when there is a straggler, else by all
    waiting: Optional[float]
    #: share of the step spent in exposed transfer, mean over ranks
    transfer: Optional[float]
    #: the run's bandwidth: median over ranks of their bandwidth
    bandwidth: Optional[float]


@dataclass(frozen=True)
class RunSnapshot:
    """What a run looks like now: one row per rank and a per-step series."""

    ranks: tuple[RankSnapshot, ...]
    series: tuple[StepPoint, ...] = ()
    stragglers: tuple[int, ...] = ()
    elapsed_s: float = 0.0  # from the first to the last telemetry event
    comm_bytes: int = 0
    comm_events: int = 0
    #: name -> rank -> ((step, value), ...): what ``nbdist.log`` was given, oldest first
    scalar_series: dict[str, dict[int, tuple[tuple[float, float], ...]]] = field(
        default_factory=dict)
    #: wall-clock seconds since the run started (until it ended); set by the run's record
    wall_s: Optional[float] = None
    dims: tuple[DimPoint, ...] = ()  # collectives by mesh dimension
    #: the hang doctor's verdict once the run has made no progress past its threshold
    stall: Optional[Verdict] = None
    #: what the session noted during the run (e.g. a rank elastic training lost and healed)
    notes: tuple[str, ...] = ()

    @property
    def bubble(self) -> Optional[float]:
        """The pipeline's bubble: the mean over its ranks of each one's idle fraction."""
        parts = [r.pipeline.bubble for r in self.ranks if r.pipeline is not None]
        return sum(parts) / len(parts) if parts else None

    @property
    def has_telemetry(self) -> bool:
        return self.stall is not None or any(r.steps or r.bar or r.scalars or r.collectives
                                             for r in self.ranks)

    @property
    def failed(self) -> tuple[RankSnapshot, ...]:
        return tuple(r for r in self.ranks if r.state == RankState.FAILED)

    @property
    def finished(self) -> bool:
        return not any(r.state.active for r in self.ranks)

    @property
    def steps(self) -> int:
        """Steps every rank has completed."""
        return min((r.steps for r in self.ranks if r.state != RankState.WAITING), default=0)

    @property
    def scalars(self) -> dict[str, float]:
        """The latest logged values of the lowest rank that logged any."""
        return next((r.scalars for r in self.ranks if r.scalars), {})

    @property
    def bandwidth(self) -> Optional[float]:
        """The run's bandwidth: the median over ranks of each rank's (bytes / transfer time)."""
        bws = [r.bandwidth for r in self.ranks if r.bandwidth is not None]
        return statistics.median(bws) if bws else None

    @property
    def diagnosis(self) -> Diagnosis:
        """The straggler (if any), its compute, and the shares of waiting and transfer."""
        stepped = [r for r in self.ranks if r.step_s]
        w = max((r for r in self.ranks if r.rank in self.stragglers),
                key=lambda r: r.straggler_score, default=None)
        waiters = [r for r in stepped if w is None or r.rank != w.rank]
        waiting = [f for f in (r.waiting_fraction for r in waiters) if f is not None]
        transfer = [f for f in (r.transfer_fraction for r in stepped) if f is not None]
        return Diagnosis(
            waited_for=w.rank if w is not None else None,
            compute_s=w.compute_s if w is not None else None,
            slower_by_s=w.slower_by_s if w is not None else None,
            waiting=statistics.fmean(waiting) if waiting else None,
            transfer=statistics.fmean(transfer) if transfer else None,
            bandwidth=self.bandwidth)

    def __repr__(self) -> str:
        rates = [r.steps_per_s for r in self.ranks if r.steps_per_s]
        parts = [f"{len(self.ranks)} ranks", f"{self.steps} steps"]
        if rates:
            parts.append(fmt_rate(min(rates), "steps/s"))
        if self.stragglers:
            parts.append("straggler: rank " + ",".join(map(str, self.stragglers)))
        if self.failed:
            parts.append("failed: rank " + ",".join(str(r.rank) for r in self.failed))
        return f"<RunSnapshot: {', '.join(parts)}>"

    def _repr_html_(self) -> str:
        from ..display.html import run_summary  # views live in display; numbers stay here

        return run_summary(self)


# ----------------------------------------------------------------- the fold
class _Rank:
    def __init__(self, history: int) -> None:
        self.state = RankState.WAITING
        self.error: Optional[str] = None
        self.steps = 0
        self.recent: deque[Event] = deque(maxlen=WINDOW)
        self.comm: dict[int, list[Event]] = {}  # step → its collectives, until the step lands
        self.bar_id: Optional[int] = None
        self.bar: Optional[Event] = None
        self.bar_points: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self.scalars: dict[str, float] = {}
        self.history = history
        self.scalar_points: dict[str, deque[tuple[float, float]]] = {}
        self.free_seq: dict[str, int] = {}  # op → collectives outside steps seen so far
        self.free = 0
        self.free_waiting = 0.0
        self.free_transfer = 0.0
        self.free_bw: deque[float] = deque(maxlen=WINDOW)
        self.memory: Optional[Event] = None
        self.step_bytes: deque[int] = deque(maxlen=WINDOW)
        self.pipes: deque[Event] = deque(maxlen=WINDOW)  # schedule steps
        self.stage_s: dict[str, deque[float]] = {}  # "forward"/"backward" -> per microbatch

    def log(self, values: Mapping[str, float], step: Optional[int]) -> None:
        self.scalars.update(values)
        for k, v in values.items():
            pts = self.scalar_points.setdefault(k, deque(maxlen=self.history))
            x = float(step) if step is not None else (pts[-1][0] + 1 if pts else 0.0)
            pts.append((x, v))


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
        self._ranks: dict[int, _Rank] = {r: _Rank(history) for r in ranks}
        self._pending: dict[int, dict[int, RankStep]] = {}  # step → reports so far
        self._matched: deque[MatchedStep] = deque(maxlen=WINDOW)
        self._series: dict[int, StepPoint] = {}
        self._free: dict[tuple[str, int], dict[int, tuple[float, int]]] = {}
        self.recorded: dict[int, deque[Event]] = {}
        self.dropped = 0
        self._nrecorded = 0
        self._t0: Optional[float] = None
        self._t1: Optional[float] = None
        self._bytes = 0
        self._ncomm = 0
        self._dims: dict[str, list] = {}  # dim -> [ops, calls, bytes, seconds]
        #: progress, step times and where each rank said it was (the hang doctor's input)
        self.stall = StallWatch(started, stall_after)

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
        """Fold one event from ``rank``."""
        st = self._ranks.get(rank)
        if st is None:
            st = self._ranks[rank] = _Rank(self._history)
        kind = e["kind"]
        if kind == STACK:  # where the rank is: not a timed event, kept apart from the trace
            self.stall.stack(rank, e)
            if st.state == RankState.WAITING:
                st.state = RankState.RUNNING
            return
        if kind != END:
            self._record(rank, e)
        t = e.get("t1", e.get("t"))
        if t is not None:
            self._t0 = min(self._t0, e.get("t0", t)) if self._t0 is not None else e.get("t0", t)
            self._t1 = max(self._t1, t) if self._t1 is not None else t
        if st.state == RankState.WAITING and kind != END:
            st.state = RankState.RUNNING
        if kind in PROGRESS_KINDS and t is not None:
            self.stall.progress(t, rank)
        if kind == STEP:
            self.stall.step(e["t1"] - e["t0"], e["t1"], rank)
            self._step(rank, st, e)
        elif kind == COMM:
            self._bytes += e["bytes"]
            self._ncomm += 1
            if e.get("step") is not None:
                st.comm.setdefault(e["step"], []).append(e)
            else:
                self._free_collective(rank, st, e)
            if e.get("dim") is not None:
                d = self._dims.setdefault(e["dim"], [set(), 0, 0, 0.0])
                d[0].add(e["op"])
                d[1] += 1
                d[2] += e["bytes"]
                d[3] += e["t1"] - e["t0"]
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
            st.log(e["values"], e.get("step"))
        elif kind == MEMORY:
            if st.memory is None or e["params"] or e["grads"] or e["optimizer"]:
                # A cell's last sample comes after its locals are gone: keep what the rank
                # held while it trained.
                st.memory = e
        elif kind == END:
            st.state = RankState.DONE if e["ok"] else RankState.FAILED
            st.error = e.get("error")
            self.stall.end(rank, e["t"], e["ok"], st.error)
            self._settle_all()  # steps this rank will never report no longer wait for it

    def _record(self, rank: int, e: Event) -> None:
        rec = self.recorded.setdefault(rank, deque())
        rec.append(e)
        self._nrecorded += 1
        if self._nrecorded > MAX_RECORDED:
            rec.popleft()
            self._nrecorded -= 1
            self.dropped += 1

    # ------------------------------------------------------------- matching across ranks
    def _step(self, rank: int, st: _Rank, e: Event) -> None:
        st.steps += 1
        st.recent.append(e)
        comms = st.comm.pop(e["step"], [])
        timed = [c for c in comms if c["t1"] > c["t0"]]
        st.step_bytes.append(sum(c["bytes"] for c in comms))
        step_s = e["t1"] - e["t0"]
        report = RankStep(step_s, min(e["comm_exposed_s"], step_s),
                          union_seconds((c["t0"], c["t1"]) for c in timed),
                          sum(c["bytes"] for c in timed),
                          timed=not any(c.get("measured") == "untimed" for c in comms))
        self._pending.setdefault(e["step"], {})[rank] = report
        while len(self._pending) > self._history:  # a rank stopped reporting: give up on it
            del self._pending[min(self._pending)]
        if e["step"] in self._pending:  # not given up already: a rank far behind (async)
            self._settle(e["step"])

    def _waiting_on(self, reporters: Iterable[int]) -> bool:
        """True while a rank that has not reported may still report (it has not ended)."""
        have = set(reporters)
        return any(st.state.active and r not in have for r, st in self._ranks.items())

    def _settle(self, step: int) -> None:
        reports = self._pending[step]
        if self._waiting_on(reports):
            return
        del self._pending[step]
        m = match_step(step, reports)
        self._matched.append(m)
        reps = list(reports.values())
        k = len(reps)
        bws = [b for b in (m.bandwidth(r) for r in reports) if b is not None]
        self._series[step] = StepPoint(
            step, sum(p.step_s for p in reps) / k, sum(p.compute_s for p in reps) / k,
            sum(m.waiting.values()) / k, m.transfer_s, sum(p.nbytes for p in reps) // k,
            statistics.median(bws) if bws else None, k, m.last)
        while len(self._series) > self._history:
            del self._series[min(self._series)]

    def _free_collective(self, rank: int, st: _Rank, e: Event) -> None:
        # Collectives run in the same order on every rank of a group: the k-th call of an op
        # on one rank is the k-th call of that op on the others.
        k = st.free_seq.get(e["op"], 0)
        st.free_seq[e["op"]] = k + 1
        if e["t1"] <= e["t0"]:
            return  # untimed
        key = (e["op"], k)
        self._free.setdefault(key, {})[rank] = (e["t1"] - e["t0"], e["bytes"])
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
            st.free_waiting += m.waiting(r)
            st.free_transfer += m.transfer_s
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
                st.state = RankState.STOPPED
                st.error = st.error or "no end-of-cell report (interrupted, or the worker died)"
        self._settle_all()

    # ------------------------------------------------------------- snapshot
    def snapshot(self, now: Optional[float] = None, at: Optional[float] = None) -> RunSnapshot:
        """The current summary; ``now`` (worker clock) makes progress ETAs count down, ``at``
        (the notebook's ``time.time()``) is when a stall is judged (None: not judged)."""
        matched = list(self._matched)
        scores = straggler_scores(matched, sorted(self._ranks))
        slow = flagged(scores, len(matched))
        compute = {r: _mean([(e["t1"] - e["t0"]) - min(e["comm_exposed_s"], e["t1"] - e["t0"])
                             for e in st.recent]) for r, st in self._ranks.items()}
        rows = []
        for r in sorted(self._ranks):
            others = [c for q, c in compute.items() if q != r and c is not None]
            gap = (compute[r] - statistics.median(others)
                   if compute[r] is not None and others else None)
            sc = scores.get(r)
            rows.append(self._rank_snapshot(r, self._ranks[r], matched, now, r in slow,
                                            sc.score if sc else 0.0, gap))
        elapsed = (self._t1 - self._t0) if self._t0 is not None and self._t1 is not None else 0.0
        curves = {}
        for r in sorted(self._ranks):
            for name, pts in self._ranks[r].scalar_points.items():
                curves.setdefault(name, {})[r] = tuple(pts)
        dims = tuple(DimPoint(dim, tuple(sorted(d[0])), d[1], d[2], d[3])
                     for dim, d in sorted(self._dims.items()))
        stall = self.verdict(at) if at is not None else None
        return RunSnapshot(tuple(rows), tuple(self._series[s] for s in sorted(self._series)),
                           tuple(slow), elapsed, self._bytes, self._ncomm, curves, dims=dims,
                           stall=stall)

    def _states(self) -> dict[int, RankState]:
        return {r: st.state for r, st in self._ranks.items()}

    def verdict(self, at: float) -> Optional[Verdict]:
        """The hang doctor's verdict at ``at`` (None: no stall past the threshold)."""
        return self.stall.verdict(self._ranks, self._states(), at)

    def where(self, at: float) -> Optional[Verdict]:
        """Where each rank was by its last report, threshold or not (for the error a timeout
        or an interrupt raises); None when no rank reported where it was."""
        return self.stall.where(self._ranks, self._states(), at)

    def _rank_snapshot(self, r: int, st: _Rank, matched: Sequence[MatchedStep],
                       now: Optional[float], straggler: bool, score: float,
                       gap: Optional[float]) -> RankSnapshot:
        recent = list(st.recent)
        sps = smp = step_s = exposed = compute = None
        if recent:
            span = recent[-1]["t1"] - recent[0]["t0"]
            if span > 0:
                sps = len(recent) / span
                smp = sum(e["samples"] for e in recent) / span
            steps = [e["t1"] - e["t0"] for e in recent]
            step_s = _mean(steps)
            exposed = _mean([min(e["comm_exposed_s"], s) for e, s in zip(recent, steps)])
            compute = None if step_s is None or exposed is None else step_s - exposed
        mine = [m for m in matched if r in m.reports]
        waiting = _mean([m.waiting[r] for m in mine])
        transfer = _mean([m.transfer_s for m in mine])
        bws = [b for b in (m.bandwidth(r) for m in mine) if b is not None] or list(st.free_bw)
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
        mem = None
        if st.memory is not None:
            m = st.memory
            mem = MemoryPoint(m["params"], m["grads"], m["optimizer"], m.get("rss"),
                              m.get("peak"), m.get("device_peak"))
        return RankSnapshot(
            r, st.state, st.error, st.steps, sps, smp, step_s, compute, exposed, waiting,
            transfer, statistics.median(bws) if bws else None, bar, dict(st.scalars),
            straggler, score, gap, st.free, st.free_waiting, st.free_transfer, memory=mem,
            bytes_per_step=statistics.fmean(st.step_bytes) if st.step_bytes else None,
            pipeline=_pipeline_point(st))

    def events(self) -> dict[int, list[Event]]:
        """The recorded telemetry events per rank (for a trace file)."""
        return {r: list(d) for r, d in self.recorded.items()}


def _mean(xs: Sequence[float]) -> Optional[float]:
    return statistics.fmean(xs) if xs else None


def aggregate(batches: Iterable[Batch], ranks: Iterable[int] = ()) -> RunSnapshot:
    """Fold ``batches`` at once (tests, and summaries of a finished run)."""
    batches = list(batches)
    # every rank that sent anything is expected: steps are split once all of them reported
    state = RunState(sorted(set(ranks) | {b["rank"] for b in batches}))
    state.feed(batches)
    return state.snapshot()


def _pipeline_point(st: _Rank) -> Optional[PipelinePoint]:
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
