"""What a run looks like now: the frozen records every view draws (a :class:`RunSnapshot`).

The fold (:mod:`.aggregate`) builds them; nothing here changes after it is built. Numbers
only: no view is imported here. In a notebook a snapshot still shows as the run's HTML
summary, because the display layer registers that drawing with IPython
(:func:`nbdist.display.summary.register_formatters`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Optional

from .recovery import Mark
from .stall.report import StallReport
from .states import RankState
from .units import fmt_rate

__all__ = ["BarState", "DimPoint", "Diagnosis", "MemoryPoint", "ModelMemory", "ModelPoint",
           "Outlier",
           "PipelinePoint", "RankSnapshot", "RunSnapshot", "RunVerdict", "StepPoint",
           "TrialPoint"]

#: steps used for rates, means and straggler scores (recent behaviour, not the whole run's)
WINDOW = 20
#: a rank stands apart, as a straggler (:func:`~.matching.flagged`) or as slower than the
#: others, only by at least this many seconds per step (timer noise on tiny steps is neither)
STRAGGLER_MIN_S = 0.001
#: the slowest ranks named as outliers: at most this many, and only those whose compute per
#: step exceeds the others' median by :data:`SLOW_SHARE` of it (and by
#: :data:`STRAGGLER_MIN_S`)
SLOWEST = 3
SLOW_SHARE = 0.05


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
    #: the bars open around it, outermost first (``epoch 2/3``)
    outer: tuple[str, ...] = ()

    @property
    def fraction(self) -> Optional[float]:
        return min(1.0, self.n / self.total) if self.total else None


@dataclass(frozen=True)
class ModelMemory:
    """What one rank holds for the optimizers its run stepped, and their parameters' sizes:
    what ZeRO's memory model predicts from (see :mod:`.verdicts`)."""

    params: int  # bytes
    grads: int
    optimizer: int
    elements: int  # the parameters' elements in full (Ψ)
    local_elements: int  # ... held by this rank (its shards)
    state_elements: int  # ... with optimizer state on this rank
    sharding: str  # "none", "zero1", "fsdp2" or "other"

    @property
    def training(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class MemoryPoint:
    """Bytes one rank held at its latest sample (see ``runtime/measure.py``)."""

    params: int
    grads: int
    optimizer: int
    rss: Optional[int]  # resident memory of the process now
    peak: Optional[int]  # its peak resident memory
    device_peak: Optional[int] = None  # torch.cuda.max_memory_allocated on a GPU
    #: what ZeRO's memory model needs of the optimizers stepped in the run
    model: Optional[ModelMemory] = None

    @property
    def training(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class ModelPoint:
    """A DDP model the run built (as its lowest rank reported it) and its communication
    setting: what runs, and which knobs nbdist set (``applied``: the session's or a trial's
    setting) or the cell's code set itself (``explicit``: they win)."""

    params: int  # elements of the parameters that train
    tensors: int
    nbytes: int  # bytes of their gradients
    bucket_cap_mb: Optional[float]
    gradient_as_bucket_view: bool
    static_graph: bool
    comm_hook: Optional[str]  # "fp16", "bf16", "powersgd", another hook's name, or None
    applied: tuple[str, ...] = ()
    explicit: tuple[str, ...] = ()

    @property
    def shape(self) -> tuple[int, int]:
        """``(parameters, tensors)``: how runs of the same model are recognised."""
        return (self.params, self.tensors)


@dataclass(frozen=True)
class TrialPoint:
    """A tuning trial's end over its ranks: the fewest optimizer steps a rank took, and
    whether the step budget cut every rank (else the cell ended first)."""

    steps: int
    budget: int
    cut: bool


@dataclass(frozen=True)
class RunVerdict:
    """One sentence about what a run's numbers mean (:mod:`.verdicts` writes them), with the
    figures it states, by name."""

    rule: Literal["exposed", "memory", "compression", "imbalance"]
    text: str
    figures: tuple[tuple[str, float], ...] = ()

    def figure(self, name: str) -> Optional[float]:
        return dict(self.figures).get(name)


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
    #: the job's index of its latest step (a replacement worker's steps keep the job's count)
    last_step: Optional[int] = None
    #: a replacement worker: the job's step it joined at
    joined_at: Optional[int] = None
    #: a worker a replacement took the place of (its row stays, apart from the replacement's)
    replaced: bool = False
    #: its latest report is this many seconds older than the others' (its counts are as of
    #: then; the other ranks' are read at one moment, so none looks ahead by reporting later)
    behind_s: Optional[float] = None

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


class Outlier(NamedTuple):
    """A rank that stands out of many: what :meth:`RunSnapshot.outliers` names."""

    rank: RankSnapshot
    #: ``"stalled"`` (away from the collective the others wait in), ``"straggler"``,
    #: ``"broken"`` (failed or stopped) or ``"slow"`` (compute per step well above the others')
    why: Literal["stalled", "straggler", "broken", "slow"]


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
    stall: Optional[StallReport] = None
    #: what the session noted during the run (e.g. a rank elastic training lost and healed)
    notes: tuple[str, ...] = ()
    #: name -> ((step, min, median, max), ...) over the ranks that logged it at that step
    scalar_spread: dict[str, tuple[tuple[float, float, float, float], ...]] = field(
        default_factory=dict)
    #: workers replacements took the place of, each with its own numbers
    former: tuple[RankSnapshot, ...] = ()
    #: what happened to the job (a rank died, a replacement joined), at the step it happened
    marks: tuple[Mark, ...] = ()
    #: seconds without progress while the run goes on, once worth saying (before any verdict)
    idle_s: Optional[float] = None
    #: what stopped the run: ``--timeout 16 s`` or ``interrupt`` (None: it ended by itself)
    stopped_by: Optional[str] = None
    #: the DDP models the run built, in order, with their communication setting
    models: tuple[ModelPoint, ...] = ()
    #: a tuning trial's end (None: the run was no trial)
    trial: Optional[TrialPoint] = None
    #: what the numbers mean, once the run is over (at most three; see :mod:`.verdicts`)
    verdicts: tuple[RunVerdict, ...] = ()

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
    def has_news(self) -> bool:
        """Something to show: numbers, a verdict, what happened, or a run that went quiet."""
        return (self.has_telemetry or bool(self.marks) or self.idle_s is not None
                or self.stopped_by is not None)

    @property
    def failed(self) -> tuple[RankSnapshot, ...]:
        return tuple(r for r in self.ranks if r.state == RankState.FAILED)

    @property
    def finished(self) -> bool:
        return not any(r.state.active for r in self.ranks)

    @property
    def steps(self) -> int:
        """The job's steps every rank in it has completed (a rank that died and was not
        replaced counts no more; a replacement counts in the job's steps, from where it
        joined)."""
        return min((r.last_step + 1 if r.last_step is not None else 0 for r in self.ranks
                    if r.state not in (RankState.WAITING, RankState.DIED)), default=0)

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
        stepped = [r for r in self.ranks if r.step_s and r.state != RankState.DIED]
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

    def outliers(self) -> tuple[Outlier, ...]:
        """The ranks that stand apart, in rank order: ranks the hang doctor found away from
        the collective the others wait in, stragglers, failed or stopped ranks, and the
        :data:`SLOWEST` ranks whose compute per step exceeds the others' median by
        :data:`SLOW_SHARE` of it (and by :data:`STRAGGLER_MIN_S`)."""
        stalled = set(self.stall.missing) if self.stall is not None else set()
        slow = sorted((r for r in self.ranks
                       if r.slower_by_s is not None and r.compute_s
                       and r.slower_by_s >= max(STRAGGLER_MIN_S, SLOW_SHARE * r.compute_s)),
                      key=lambda r: -(r.slower_by_s or 0.0))[:SLOWEST]
        slowest = {r.rank for r in slow}
        out = []
        for r in self.ranks:
            if r.rank in stalled:
                out.append(Outlier(r, "stalled"))
            elif r.straggler:
                out.append(Outlier(r, "straggler"))
            elif r.state.broken:
                out.append(Outlier(r, "broken"))
            elif r.rank in slowest:
                out.append(Outlier(r, "slow"))
        return tuple(out)

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
