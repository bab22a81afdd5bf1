"""Fold telemetry events into a :class:`RunSnapshot`: the numbers every view draws.

Pure: no IPython, widgets, processes or clocks (callers pass ``now``). Views call
:meth:`RunState.feed` with the event batches of a run and :meth:`RunState.snapshot` when they
redraw; everything here is unit-tested on synthetic event streams.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from .events import (
    COMM,
    END,
    MEMORY,
    PIPELINE,
    PROGRESS,
    SCALARS,
    STAGE,
    STEP,
    TELEMETRY,
    Batch,
    Event,
)
from .intervals import bandwidth, bubble_fraction, rate
from .states import RankState
from .units import fmt_rate

#: steps used for rates and medians (recent behaviour, not the whole run's average)
WINDOW = 20
#: a rank whose median compute time per step exceeds the others' by this factor is flagged
STRAGGLER_RATIO = 1.2
#: ... and by at least this many seconds (timer noise on tiny steps is not a straggler)
STRAGGLER_MIN_S = 0.002
#: steps every rank needs before anyone is called a straggler
STRAGGLER_MIN_STEPS = 5
#: events kept per run for ``%nbdist timeline`` (older ones are dropped first)
MAX_RECORDED = 200_000


# ----------------------------------------------------------------- stragglers
def find_stragglers(compute: dict[int, Sequence[float]], *, ratio: float = STRAGGLER_RATIO,
                    min_s: float = STRAGGLER_MIN_S,
                    min_steps: int = STRAGGLER_MIN_STEPS) -> list[int]:
    """Ranks whose median compute time per step is consistently above the others'.

    ``compute`` maps rank → recent compute seconds per step (step time minus exposed
    communication: in data-parallel training every rank waits for the slowest, so the wait
    shows up as exposed communication on the fast ranks, not as a longer step).
    """
    medians = {r: statistics.median(v) for r, v in compute.items() if len(v) >= min_steps}
    if len(medians) < 2:
        return []
    out = []
    for r, m in medians.items():
        others = statistics.median(v for q, v in medians.items() if q != r)
        if m > others * ratio and m - others > min_s:
            out.append(r)
    return sorted(out)


# ----------------------------------------------------------------- snapshot records
@dataclass(frozen=True)
class StepPoint:
    """One step, averaged over the ranks that reported it."""

    step: int
    step_s: float
    compute_s: float
    exposed_s: float
    comm_s: float
    nbytes: int
    bandwidth: Optional[float]  # bytes/s
    ranks: int


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
    rank: int
    state: RankState
    error: Optional[str] = None
    steps: int = 0
    steps_per_s: Optional[float] = None
    samples_per_s: Optional[float] = None
    step_s: Optional[float] = None  # median of recent steps
    exposed_s: Optional[float] = None
    bandwidth: Optional[float] = None
    bar: Optional[BarState] = None
    scalars: dict[str, float] = field(default_factory=dict)
    straggler: bool = False
    memory: Optional[MemoryPoint] = None
    bytes_per_step: Optional[float] = None  # mean payload of a step's collectives (recent)
    pipeline: Optional[PipelinePoint] = None

    @property
    def exposed_fraction(self) -> Optional[float]:
        if self.step_s and self.exposed_s is not None:
            return min(1.0, self.exposed_s / self.step_s)
        return None


@dataclass(frozen=True)
class RunSnapshot:
    """What a run looks like now: one row per rank and a per-step series."""

    ranks: tuple[RankSnapshot, ...]
    series: tuple[StepPoint, ...] = ()
    stragglers: tuple[int, ...] = ()
    elapsed_s: float = 0.0
    comm_bytes: int = 0
    comm_events: int = 0
    dims: tuple[DimPoint, ...] = ()  # collectives by mesh dimension

    @property
    def bubble(self) -> Optional[float]:
        """The pipeline's bubble: the mean over its ranks of each one's idle fraction."""
        parts = [r.pipeline.bubble for r in self.ranks if r.pipeline is not None]
        return sum(parts) / len(parts) if parts else None

    @property
    def has_telemetry(self) -> bool:
        return any(r.steps or r.bar or r.scalars for r in self.ranks)

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
    def __init__(self) -> None:
        self.state = RankState.WAITING
        self.error: Optional[str] = None
        self.steps = 0
        self.recent: deque[Event] = deque(maxlen=WINDOW)
        self.bw: deque[float] = deque(maxlen=WINDOW)
        self.comm: dict[int, list[Event]] = {}  # step → its collectives, until the step lands
        self.bar_id: Optional[int] = None
        self.bar: Optional[Event] = None
        self.bar_points: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self.scalars: dict[str, float] = {}
        self.memory: Optional[Event] = None
        self.step_bytes: deque[int] = deque(maxlen=WINDOW)
        self.pipes: deque[Event] = deque(maxlen=WINDOW)  # schedule steps
        self.stage_s: dict[str, deque[float]] = {}  # "forward"/"backward" -> per microbatch


class RunState:
    """Accumulates a run's event batches; :meth:`snapshot` summarizes them.

    Parameters
    ----------
    ranks : sequence of int
        Ranks expected to report (others are added as they appear).
    history : int
        Steps kept for the per-step series (the chart's x-axis).
    """

    def __init__(self, ranks: Iterable[int] = (), history: int = 300):
        self._ranks: dict[int, _Rank] = {r: _Rank() for r in ranks}
        self._points: dict[int, dict[int, tuple[float, float, float, int, Optional[float]]]] = {}
        self._history = history
        self.recorded: dict[int, deque[Event]] = {}
        self.dropped = 0
        self._nrecorded = 0
        self._t0: Optional[float] = None
        self._t1: Optional[float] = None
        self._bytes = 0
        self._ncomm = 0
        self._dims: dict[str, list] = {}  # dim -> [ops, calls, bytes, seconds]

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
        st = self._ranks.setdefault(rank, _Rank())
        kind = e["kind"]
        if kind != END:
            rec = self.recorded.setdefault(rank, deque())
            rec.append(e)
            self._nrecorded += 1
            if self._nrecorded > MAX_RECORDED:
                rec.popleft()
                self._nrecorded -= 1
                self.dropped += 1
        t = e.get("t1", e.get("t"))
        if t is not None:
            self._t0 = min(self._t0, e.get("t0", t)) if self._t0 is not None else e.get("t0", t)
            self._t1 = max(self._t1, t) if self._t1 is not None else t
        if st.state == RankState.WAITING and kind != END:
            st.state = RankState.RUNNING
        if kind == STEP:
            self._step(rank, st, e)
        elif kind == COMM:
            self._bytes += e["bytes"]
            self._ncomm += 1
            if e.get("step") is not None:
                st.comm.setdefault(e["step"], []).append(e)
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
            st.scalars.update(e["values"])
        elif kind == MEMORY:
            if st.memory is None or e["params"] or e["grads"] or e["optimizer"]:
                # A cell's last sample comes after its locals are gone: keep what the rank
                # held while it trained.
                st.memory = e
        elif kind == END:
            st.state = RankState.DONE if e["ok"] else RankState.FAILED
            st.error = e.get("error")

    def _step(self, rank: int, st: _Rank, e: Event) -> None:
        st.steps += 1
        st.recent.append(e)
        comms = st.comm.pop(e["step"], [])
        nbytes = sum(c["bytes"] for c in comms)
        st.step_bytes.append(nbytes)
        bw = bandwidth(nbytes, [(c["t0"], c["t1"]) for c in comms])
        if bw is not None:
            st.bw.append(bw)
        step_s = e["t1"] - e["t0"]
        exposed = min(e["comm_exposed_s"], step_s)
        row = self._points.setdefault(e["step"], {})
        row[rank] = (step_s, exposed, e["comm_total_s"], nbytes, bw)
        if len(self._points) > self._history:
            del self._points[min(self._points)]

    def finish(self) -> None:
        """The run is over: ranks that never said they finished are marked stopped."""
        for st in self._ranks.values():
            if st.state == RankState.RUNNING:
                st.state = RankState.STOPPED
                st.error = st.error or "no end-of-cell report (interrupted, or the worker died)"

    def snapshot(self, now: Optional[float] = None) -> RunSnapshot:
        """The current summary; ``now`` (worker clock) makes progress ETAs count down."""
        compute = {r: [(e["t1"] - e["t0"]) - min(e["comm_exposed_s"], e["t1"] - e["t0"])
                       for e in st.recent] for r, st in self._ranks.items()}
        slow = set(find_stragglers(compute))
        rows = []
        for r in sorted(self._ranks):
            st = self._ranks[r]
            rows.append(self._rank_snapshot(r, st, r in slow))
        series = []
        for step in sorted(self._points):
            vals = list(self._points[step].values())
            k = len(vals)
            bws = [v[4] for v in vals if v[4] is not None]
            step_s = sum(v[0] for v in vals) / k
            exposed = sum(v[1] for v in vals) / k
            series.append(StepPoint(step, step_s, step_s - exposed, exposed,
                                    sum(v[2] for v in vals) / k, sum(v[3] for v in vals) // k,
                                    sum(bws) / len(bws) if bws else None, k))
        elapsed = (self._t1 - self._t0) if self._t0 is not None and self._t1 is not None else 0.0
        dims = tuple(DimPoint(dim, tuple(sorted(d[0])), d[1], d[2], d[3])
                     for dim, d in sorted(self._dims.items()))
        return RunSnapshot(tuple(rows), tuple(series), tuple(sorted(slow)), elapsed,
                           self._bytes, self._ncomm, dims)

    def _rank_snapshot(self, r: int, st: _Rank, straggler: bool) -> RankSnapshot:
        recent = list(st.recent)
        sps = smp = step_s = exposed = None
        if recent:
            span = recent[-1]["t1"] - recent[0]["t0"]
            if span > 0:
                sps = len(recent) / span
                smp = sum(e["samples"] for e in recent) / span
            step_s = statistics.median(e["t1"] - e["t0"] for e in recent)
            exposed = statistics.median(e["comm_exposed_s"] for e in recent)
        bar = None
        if st.bar is not None:
            b = st.bar
            rt = rate(list(st.bar_points))
            eta = ((b["total"] - b["n"]) / rt if rt and b["total"] is not None
                   and not b["done"] else None)
            bar = BarState(b["desc"], b["n"], b["total"], rt, eta, b["done"])
        mem = None
        if st.memory is not None:
            m = st.memory
            mem = MemoryPoint(m["params"], m["grads"], m["optimizer"], m.get("rss"),
                              m.get("peak"), m.get("device_peak"))
        return RankSnapshot(r, st.state, st.error, st.steps, sps, smp, step_s, exposed,
                            statistics.median(st.bw) if st.bw else None, bar,
                            dict(st.scalars), straggler, mem,
                            statistics.fmean(st.step_bytes) if st.step_bytes else None,
                            _pipeline_point(st))

    def events(self) -> dict[int, list[Event]]:
        """The recorded telemetry events per rank (for a trace file)."""
        return {r: list(d) for r, d in self.recorded.items()}


def aggregate(batches: Iterable[Batch], ranks: Iterable[int] = ()) -> RunSnapshot:
    """Fold ``batches`` at once (tests, and summaries of a finished run)."""
    state = RunState(ranks)
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
