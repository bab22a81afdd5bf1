"""The run tables and header phrases nbdist shows, as plain strings: text.py and html.py only
lay them out (through :mod:`nbdist.table_layout`).

One builder per table, so the text and HTML views cannot drift apart in their headers or in
how a number is written. Pure: no markup, no IPython; which ranks stand out is the snapshot's
to say (:meth:`~nbdist.telemetry.snapshot.RunSnapshot.outliers`), the tables only name them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, Optional

from ..table_layout import Row, Table
from ..telemetry.stall.report import IN_COLLECTIVE
from ..telemetry.stall.words import headline, where_lines
from ..telemetry.states import RankState
from ..telemetry.units import (
    fmt_bytes,
    fmt_bytes_rate,
    fmt_fraction,
    fmt_ranks,
    fmt_rate,
    fmt_seconds,
    one_unit,
)

if TYPE_CHECKING:
    from ..telemetry.snapshot import (
        BarState,
        MemoryPoint,
        Outlier,
        PipelinePoint,
        RankSnapshot,
        RunSnapshot,
    )

RUN_HEADER = ("rank", "progress", "count", "rate", "ETA", "compute", "waiting", "transfer",
              "bandwidth", "last values", "state")
#: more ranks than this are shown as min / median / max rows and the outliers, by name
AGGREGATE_ABOVE = 16
#: outliers (:meth:`~nbdist.telemetry.snapshot.RunSnapshot.outliers`) named one per row in the
#: aggregate table
MAX_OUTLIERS = 6

#: what each run column means; the legend and docs/telemetry.md say the same
DEFINITIONS = (
    ("count", "items of the rank's nbdist.progress bar (else its training steps)"),
    ("rate", "items (or steps) per second over the last 20"),
    ("compute", "step time less exposed communication, mean of the last 20 steps"),
    ("waiting", "exposed time spent waiting for the last rank to reach the collective"),
    ("transfer", "exposed time the last rank to arrive spends in it: the transfer itself"),
    ("bandwidth", "bytes of the step's collectives ÷ their transfer time (the time the rank "
                  "that waited least spent in them); median of the last 20 steps"),
    ("Σ", "collectives outside training steps: total over the run"),
)
MEMORY_HEADER = ("rank", "params", "grads", "optimizer", "comm/step", "RSS", "peak RSS",
                 "GPU peak")
PIPELINE_HEADER = ("rank", "stage", "schedule", "microbatches", "forward/mb", "backward/mb",
                   "p2p wait/step", "step", "bubble")
DIMS_HEADER = ("mesh dim", "collectives", "calls", "bytes", "time (all ranks)")
MEMORY_CAPTION = "memory per rank at its last report (comm/step: bytes it sends per step)"


def _one_unit(table: Table) -> Table:
    """The table with each column's sizes, durations and rates in one unit."""
    columns = list(zip(*(row.cells for row in table.rows))) if table.rows else []
    cells = list(zip(*(one_unit(c) for c in columns)))
    return Table(table.header, tuple(row._replace(cells=tuple(c))
                                     for row, c in zip(table.rows, cells)))


# ----------------------------------------------------------------- run table
def stop_phrase(by: str, short: bool = False) -> str:
    """``stopped by --timeout 16 s`` (``short``: without the seconds), or ``interrupted``."""
    if by == "interrupt":
        return "interrupted"
    return f"stopped by {by.split()[0] if short else by}"


def _where(snap: RunSnapshot, r: RankSnapshot) -> tuple[str, bool]:
    """What the hang doctor's report says of a rank: ``waiting in all_reduce``, or ``held the
    others`` (and where it was) for a rank that never reached the collective they wait in;
    and whether it is that rank."""
    v = snap.stall
    w = v.rank(r.rank) if v is not None else None
    if w is None:
        return "", False
    if r.rank in v.missing:  # type: ignore[union-attr]
        script = v.script  # type: ignore[union-attr]
        at = "" if w.line is None else f" at {script}:{w.line}" if script else \
            f" at line {w.line}"
        return f"held the others: in {w.doing}{at}" if w.doing else "held the others", True
    if w.status == IN_COLLECTIVE and w.collective is not None:
        return f"waiting in {w.collective.op}", False
    return "", False


def _state_cell(r: RankSnapshot, note: str = "", snap: Optional[RunSnapshot] = None) -> str:
    """``running, straggler``; ``died: SIGKILL · replaced``; ``stopped by --timeout · waiting
    in all_reduce``; ``running · joined at step 31``."""
    stopped = snap is not None and snap.stopped_by and r.state == RankState.STOPPED
    state = stop_phrase(snap.stopped_by, short=True) if stopped else str(r.state)  # type: ignore
    where, held = _where(snap, r) if snap is not None else ("", False)
    note = "" if held and note == "stalled" else note  # "held the others" says more
    state += (", straggler" if r.straggler else "") + (f", {note}" if note else "")
    extra = [x for x in (where, "replaced" if r.replaced else "",
                         f"joined at step {r.joined_at}" if r.joined_at is not None else "",
                         f"as of {fmt_seconds(r.behind_s)} before the others"
                         if r.behind_s is not None else "") if x]
    if r.error:
        # Remote reasons may span lines; one line keeps the text table aligned.
        state = f"{state}: {' '.join(r.error.split())}"
    return " · ".join([state, *extra])


def _count(r: RankSnapshot) -> Optional[float]:
    return float(r.bar.n) if r.bar is not None else (float(r.steps) if r.steps else None)


def _rate(r: RankSnapshot) -> Optional[float]:
    return r.bar.rate if r.bar is not None else r.steps_per_s


def _count_unit(r: RankSnapshot) -> str:
    return "it" if r.bar is not None else "steps"


def _comm(r: RankSnapshot, per_step: Optional[float], total: float) -> str:
    if per_step is not None:
        return fmt_seconds(per_step)
    return f"Σ {fmt_seconds(total)}" if r.collectives else "-"


def _values(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in values.items())


def _progress_label(b: BarState) -> str:
    """``epoch 1 · 50%``: the bar's name and where it is, so rows on different bars (an
    epoch ahead) cannot read as one ahead of the other."""
    pct = fmt_fraction(b.fraction) if b.total else ""
    return " · ".join(x for x in (b.desc, pct) if x)


def _counted(n: int, noun: str) -> str:
    """``1 step``, ``3 steps``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _rank_row(r: RankSnapshot, note: str = "", snap: Optional[RunSnapshot] = None) -> Row:
    b = r.bar
    if b is not None:
        count = f"{b.n}/{b.total} it" if b.total is not None else f"{b.n} it"
        rate = fmt_rate(b.rate, "it/s") if b.rate is not None else "-"
    else:
        count = (_counted(r.steps, "step") if r.steps else
                 _counted(r.collectives, "call") if r.collectives else "-")
        rate = fmt_rate(r.steps_per_s, "steps/s") if r.steps_per_s else "-"
    frac = b.fraction if b is not None else None
    if frac is None and not r.state.active and r.state != RankState.WAITING:
        frac = 1.0 if r.state == RankState.DONE else None
    cells = (str(r.rank), _progress_label(b) if b is not None else "",
             count, rate, fmt_seconds(b.eta_s) if b is not None else "-",
             fmt_seconds(r.compute_s),
             _comm(r, r.waiting_s, r.collective_waiting_s),
             _comm(r, r.transfer_s, r.collective_transfer_s),
             fmt_bytes_rate(r.bandwidth), _values(r.scalars), _state_cell(r, note, snap))
    stopped = snap is not None and bool(snap.stopped_by) and r.state == RankState.STOPPED
    held = snap is not None and _where(snap, r)[1]
    return Row(cells, broken=r.state.broken and not stopped, straggler=r.straggler,
               fraction=frac, state=str(r.state), rank=r.rank, held=held, former=r.replaced)


def _spread(ranks: Sequence[RankSnapshot], get: Callable[[RankSnapshot], Optional[float]]
            ) -> Optional[tuple[float, float, float]]:
    xs = sorted(x for x in map(get, ranks) if x is not None)
    return (xs[0], statistics.median(xs), xs[-1]) if xs else None


def _outliers(snap: RunSnapshot) -> list[tuple[RankSnapshot, str]]:
    """The snapshot's outliers, each with the note its state cell adds ("" when its state
    says it: a straggler, a failed or stopped rank)."""
    def note(o: Outlier) -> str:
        if o.why == "slow":
            return f"slow: +{fmt_seconds(o.rank.slower_by_s)}/step"
        return "stalled" if o.why == "stalled" else ""

    return [(o.rank, note(o)) for o in snap.outliers()]


def _more_row(rest: Sequence[tuple[RankSnapshot, str]], width: int, at: int) -> Row:
    """``…  N more  ranks 7,9-12``: the outliers past :data:`MAX_OUTLIERS`."""
    cells = ["…"] + [""] * (width - 1)
    cells[at] = f"{len(rest)} more"
    cells[-1] = "ranks " + fmt_ranks(r.rank for r, _ in rest)
    return Row(tuple(cells), broken=any(r.state.broken for r, _ in rest))


def _aggregate_rows(snap: RunSnapshot) -> tuple[Row, ...]:
    """Min, median and max over ranks for every column, then the outliers by name."""
    rs = snap.ranks
    unit = "it" if any(r.bar is not None for r in rs) else "steps"
    columns: list[tuple[Callable[[RankSnapshot], Optional[float]], Callable[[float], str]]] = [
        (lambda r: r.bar.fraction if r.bar is not None else None, fmt_fraction),
        (_count, lambda x: f"{x:.0f} {unit}"),
        (_rate, lambda x: fmt_rate(x, f"{unit}/s")),
        (lambda r: r.bar.eta_s if r.bar is not None else None, fmt_seconds),
        (lambda r: r.compute_s, fmt_seconds),
        (lambda r: r.waiting_s, fmt_seconds),
        (lambda r: r.transfer_s, fmt_seconds),
        (lambda r: r.bandwidth, fmt_bytes_rate),
    ]
    spreads = [_spread(rs, get) for get, _ in columns]
    names = list(dict.fromkeys(k for r in rs for k in r.scalars))
    value_spreads = {k: _spread(rs, lambda r, k=k: r.scalars.get(k)) for k in names}
    states: dict[str, int] = {}
    for r in rs:
        states[str(r.state)] = states.get(str(r.state), 0) + 1
    counts = ", ".join(f"{n} {s}" for s, n in states.items())
    rows = []
    for i, label in enumerate(("min", "median", "max")):
        cells = [label]
        for (_, fmt), sp in zip(columns, spreads):
            cells.append(fmt(sp[i]) if sp is not None else "-")
        cells.append(", ".join(f"{k} {sp[i]:.4g}" for k, sp in value_spreads.items()
                               if sp is not None))
        cells.append(counts if label == "median" else "")
        frac = spreads[0][i] if spreads[0] is not None else None
        rows.append(Row(tuple(cells), fraction=frac))
    named = _outliers(snap)
    rows += [_rank_row(r, note, snap) for r, note in named[:MAX_OUTLIERS]]
    if len(named) > MAX_OUTLIERS:
        rows.append(_more_row(named[MAX_OUTLIERS:], len(RUN_HEADER), 2))
    rows += [_rank_row(r, "", snap) for r in snap.former]
    return tuple(rows)


def run_table(snap: RunSnapshot, aggregate_above: int = AGGREGATE_ABOVE) -> Table:
    """One row per rank of a run, and one per worker a replacement took over from, just
    above its replacement's; above ``aggregate_above`` ranks, min / median / max rows over
    the ranks, then the outliers by name (stragglers, failed, stalled and the slowest
    ranks), then the replaced workers."""
    if len(snap.ranks) > aggregate_above:
        return _one_unit(Table(RUN_HEADER, _aggregate_rows(snap)))
    shown = sorted([*snap.ranks, *snap.former], key=lambda r: (r.rank, not r.replaced))
    return _one_unit(Table(RUN_HEADER, tuple(_rank_row(r, "", snap) for r in shown)))


# ----------------------------------------------------------------- header phrases
def progress_phrases(snap: RunSnapshot, final: bool = False) -> list[str]:
    """The run's state, time and pace: ``finished in 12.3 s``, ``train 300/300 it`` (the
    slowest rank's), ``52.3 it/s per rank``, ``1.67k samples/s all ranks`` (``ETA 4 s`` while
    it runs): each figure says whether it is one rank's or the job's."""
    wall = snap.wall_s if snap.wall_s is not None else snap.elapsed_s
    ended = final or snap.finished
    if snap.failed or ended and _lost_for_good(snap):
        head = "failed after"
    elif snap.stopped_by:
        head = f"{stop_phrase(snap.stopped_by)} after"
    elif any(r.state == RankState.STOPPED for r in snap.ranks):
        head = "stopped after"
    else:
        head = "finished in" if ended else "running for"
    out = [f"{head} {fmt_seconds(wall)}" if wall else head.rsplit(" ", 1)[0]]
    active = [r for r in snap.ranks if r.state != RankState.WAITING]
    bars = [r.bar for r in active if r.bar is not None]
    if bars:  # the job moves at its slowest rank's pace
        slow = min(bars, key=lambda b: b.n)
        total = f"/{slow.total}" if slow.total is not None else ""
        out.append(f"{slow.desc + ' ' if slow.desc else ''}{slow.n}{total} it")
        rates = [b.rate for b in bars if b.rate]
        if rates:
            out.append(fmt_rate(min(rates), "it/s") + " per rank")
    elif any(r.steps for r in active):
        out.append(_counted(snap.steps, "step"))
        rates = [r.steps_per_s for r in active if r.steps_per_s]
        if rates:
            out.append(fmt_rate(min(rates), "steps/s") + " per rank")
    samples = sum(r.samples_per_s or 0 for r in active)
    if samples:
        out.append(fmt_rate(samples, "samples/s") + " all ranks")
    etas = [b.eta_s for b in bars if b.eta_s is not None]
    if etas and not ended:
        out.append(f"ETA {fmt_seconds(max(etas))}")
    return out


def _lost_for_good(snap: RunSnapshot) -> bool:
    """A rank died and no group re-formed without it (elastic training carries on without a
    dead rank; any other job is lost with it)."""
    return (any(r.state == RankState.DIED for r in snap.ranks)
            and not any(m.kind == "re-formed" for m in snap.marks))


def quiet_phrase(snap: RunSnapshot, final: bool = False) -> str:
    """``no step for 4.2 s`` while a running run makes no progress, before any verdict (""
    otherwise)."""
    if final or snap.finished or snap.idle_s is None:
        return ""
    return f"no step for {fmt_seconds(snap.idle_s)}" if snap.has_telemetry else "no step yet"


def diagnosis_phrases(snap: RunSnapshot) -> list[str]:
    """Where the step time goes, e.g. ``rank 1 is 5.1 ms/step slower (compute 15 ms)``,
    ``others wait 26% of their step``, ``transfer 6%``, ``bandwidth 337 MB/s per rank`` (the
    median rank's)."""
    d = snap.diagnosis
    out = []
    if d.waited_for is not None:
        slower = (f"rank {d.waited_for} is {fmt_seconds(d.slower_by_s)}/step slower"
                  if d.slower_by_s is not None and d.slower_by_s > 0
                  else f"everyone waits for rank {d.waited_for}")
        out.append(slower + (f" (compute {fmt_seconds(d.compute_s)})"
                             if d.compute_s is not None else ""))
        if d.waiting is not None:
            out.append(f"others wait {fmt_fraction(d.waiting)} of their step")
    elif d.waiting is not None:
        out.append(f"waiting {fmt_fraction(d.waiting)} of the step")
    if d.transfer is not None:
        out.append(f"transfer {fmt_fraction(d.transfer)}")
    if d.bandwidth is not None:
        out.append(f"bandwidth {fmt_bytes_rate(d.bandwidth)} per rank")
    if snap.bubble is not None:
        out.append(f"pipeline bubble {fmt_fraction(snap.bubble)}")
    return out


def failure_lines(snap: RunSnapshot, aggregate_above: int = AGGREGATE_ABOVE) -> list[str]:
    """``rank 1 failed: ValueError: ...`` for every rank that failed or stopped by itself;
    above ``aggregate_above`` ranks, one line per reason (``ranks 0-511,600 failed: ...``).
    A rank that died, or that a timeout or an interrupt stopped, is said once, elsewhere:
    in its row, the header's events and the hang doctor's report."""
    broken = [(r.rank, f"{r.state}: {' '.join((r.error or str(r.state)).split())}")
              for r in snap.ranks if r.state == RankState.FAILED
              or (r.state == RankState.STOPPED and not snap.stopped_by)]
    if len(snap.ranks) <= aggregate_above:
        return [f"rank {r} {why}" for r, why in broken]
    by_reason: dict[str, list[int]] = {}
    for r, why in broken:
        by_reason.setdefault(why, []).append(r)
    return [f"rank{'s' if len(rs) > 1 else ''} {fmt_ranks(rs)} {why}"
            for why, rs in by_reason.items()]


def verdict_lines(snap: RunSnapshot) -> list[str]:
    """What the run's numbers mean, once it is over: at most three sentences (empty: the
    numbers call for none)."""
    return [v.text for v in snap.verdicts]


def stall_lines(snap: RunSnapshot) -> list[str]:
    """The hang doctor's verdict: a headline, then where each rank is (empty: no stall)."""
    v = snap.stall
    if v is None:
        return []
    return [f"hang doctor: {headline(v)}", *where_lines(v)]


def _spread_rows(ranks: Sequence[RankSnapshot], width: int,
                 columns: Sequence[tuple[Callable[[RankSnapshot], Optional[float]],
                                         Callable[[float], str]]],
                 first: Sequence[str] = ()) -> list[Row]:
    """``min``, ``median`` and ``max`` rows: ``first`` cells after the label, then each
    column's spread over ``ranks``, ``-`` where no rank has a value."""
    spreads = [_spread(ranks, get) for get, _ in columns]
    rows = []
    for i, label in enumerate(("min", "median", "max")):
        cells = [label, *first]
        cells += [fmt(sp[i]) if sp is not None else "-" for (_, fmt), sp in zip(columns, spreads)]
        rows.append(Row(tuple(cells + [""] * (width - len(cells)))))
    return rows


def _named(snap: RunSnapshot, row: Callable[[RankSnapshot], Row], width: int) -> list[Row]:
    """The outliers' own rows, then how many more there are."""
    named = _outliers(snap)
    rows = [row(r) for r, _ in named[:MAX_OUTLIERS]]
    if len(named) > MAX_OUTLIERS:
        rows.append(_more_row(named[MAX_OUTLIERS:], width, 1))
    return rows


def _memory_row(r: RankSnapshot) -> Row:
    m = r.memory
    if m is None:
        return Row((str(r.rank), *("-",) * (len(MEMORY_HEADER) - 1)), r.state.broken,
                   rank=r.rank)
    return Row((str(r.rank), fmt_bytes(m.params), fmt_bytes(m.grads), fmt_bytes(m.optimizer),
                fmt_bytes(r.bytes_per_step), fmt_bytes(m.rss), fmt_bytes(m.peak),
                fmt_bytes(m.device_peak)), r.state.broken, rank=r.rank)


def memory_table(snap: RunSnapshot, aggregate_above: int = AGGREGATE_ABOVE) -> Optional[Table]:
    """What each rank holds (local shards of sharded tensors) and sends per step; above
    ``aggregate_above`` ranks, min / median / max rows and the outliers. None when no
    rank reported memory (no optimizer stepped)."""
    if not any(r.memory for r in snap.ranks):
        return None
    if len(snap.ranks) <= aggregate_above:
        return _one_unit(Table(MEMORY_HEADER, tuple(_memory_row(r) for r in snap.ranks)))

    def mem(get: Callable[[MemoryPoint], Optional[float]]
            ) -> Callable[[RankSnapshot], Optional[float]]:
        return lambda r: get(r.memory) if r.memory is not None else None

    columns = [(mem(lambda m: m.params), fmt_bytes), (mem(lambda m: m.grads), fmt_bytes),
               (mem(lambda m: m.optimizer), fmt_bytes), (lambda r: r.bytes_per_step, fmt_bytes),
               (mem(lambda m: m.rss), fmt_bytes), (mem(lambda m: m.peak), fmt_bytes),
               (mem(lambda m: m.device_peak), fmt_bytes)]
    rows = _spread_rows(snap.ranks, len(MEMORY_HEADER), columns)
    return _one_unit(Table(MEMORY_HEADER,
                           tuple(rows + _named(snap, _memory_row, len(MEMORY_HEADER)))))


def _pipeline_row(r: RankSnapshot) -> Row:
    p = r.pipeline
    if p is None:
        return Row((str(r.rank), *("-",) * (len(PIPELINE_HEADER) - 1)), r.state.broken,
                   rank=r.rank)
    return Row((str(r.rank), p.label, p.schedule, str(p.microbatches),
                fmt_seconds(p.forward_s), fmt_seconds(p.backward_s), fmt_seconds(p.p2p_wait_s),
                fmt_seconds(p.step_s), fmt_fraction(p.bubble)), r.state.broken, rank=r.rank)


def pipeline_table(snap: RunSnapshot, aggregate_above: int = AGGREGATE_ABOVE
                   ) -> Optional[Table]:
    """Each rank's pipeline stage: time per microbatch, waits, and its bubble (idle share of a
    schedule step); above ``aggregate_above`` ranks, one row per stage with the medians over
    its ranks. None when no rank ran a pipeline schedule."""
    if not any(r.pipeline for r in snap.ranks):
        return None
    if len(snap.ranks) <= aggregate_above:
        return Table(PIPELINE_HEADER, tuple(_pipeline_row(r) for r in snap.ranks))
    stages: dict[str, list[RankSnapshot]] = {}
    for r in snap.ranks:
        if r.pipeline is not None:
            stages.setdefault(r.pipeline.label, []).append(r)
    rows = []
    for label, rs in stages.items():
        p = rs[0].pipeline
        assert p is not None

        def med(get: Callable[[PipelinePoint], Optional[float]], rs: list = rs
                ) -> Optional[float]:
            xs = [x for x in (get(r.pipeline) for r in rs) if x is not None]
            return statistics.median(xs) if xs else None

        rows.append(Row((f"ranks {fmt_ranks(r.rank for r in rs)}", label, p.schedule,
                         str(p.microbatches), fmt_seconds(med(lambda q: q.forward_s)),
                         fmt_seconds(med(lambda q: q.backward_s)),
                         fmt_seconds(med(lambda q: q.p2p_wait_s)),
                         fmt_seconds(med(lambda q: q.step_s)),
                         fmt_fraction(med(lambda q: q.bubble))),
                        any(r.state.broken for r in rs)))
    return Table(PIPELINE_HEADER, tuple(rows))


def dims_table(snap: RunSnapshot) -> Optional[Table]:
    """Collectives by device-mesh dimension (``tp``, ``dp``...); None when none was named."""
    if not snap.dims:
        return None
    return Table(DIMS_HEADER, tuple(
        Row((d.dim, ", ".join(d.ops), str(d.calls), fmt_bytes(d.nbytes), fmt_seconds(d.seconds)))
        for d in snap.dims))
