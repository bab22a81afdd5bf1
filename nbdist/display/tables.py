"""The tables nbdist shows, as plain strings: text.py and html.py only lay them out.

One builder per table, so the text and HTML views cannot drift apart in their headers or in
how a number is written. Pure: no markup, no IPython; the snapshot types are imported for
annotations only (``records`` and ``aggregate`` import the views back for their reprs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Optional

from ..telemetry.units import fmt_bytes, fmt_bytes_rate, fmt_fraction, fmt_rate, fmt_seconds

if TYPE_CHECKING:
    from ..records import ClusterStatus
    from ..telemetry.aggregate import RankSnapshot, RunSnapshot
    from ..telemetry.compare import RunFigures


class Row(NamedTuple):
    cells: tuple[str, ...]
    #: a dead worker, or a rank that failed or stopped: views draw it in the failure colour
    broken: bool = False


class Table(NamedTuple):
    """A header and its rows, every cell already formatted. Unpacks as ``header, rows``."""

    header: tuple[str, ...]
    rows: tuple[Row, ...]


STATUS_HEADER = ("rank", "host", "pid", "device", "alive", "mem MiB", "state")
RUN_HEADER = ("rank", "state", "steps", "steps/s", "samples/s", "step time", "exposed comm",
              "all-reduce bw")
MEMORY_HEADER = ("rank", "params", "grads", "optimizer", "comm/step", "RSS", "peak RSS",
                 "GPU peak")
PIPELINE_HEADER = ("rank", "stage", "schedule", "microbatches", "forward/mb", "backward/mb",
                   "p2p wait/step", "step", "bubble")
DIMS_HEADER = ("mesh dim", "collectives", "calls", "bytes", "time (all ranks)")


def _or_dash(value: Optional[object]) -> str:
    return "-" if value is None else str(value)


def status_rows(status: ClusterStatus) -> Table:
    """One row per worker of a cluster's status (``NO`` for a dead worker: text has no red)."""
    rows = tuple(
        Row((_or_dash(w.rank), w.hostname, str(w.pid or "-"), w.device or "-",
             "yes" if w.alive else "NO",
             f"{w.rss_mb:.0f}" if w.rss_mb is not None else "-", w.state),
            broken=not w.alive)
        for w in status.rows)
    return Table(STATUS_HEADER, rows)


def _state_cell(r: RankSnapshot) -> str:
    if not r.error:
        return str(r.state)
    # Remote reasons may span lines; one line keeps the text table aligned (HTML folds them anyway).
    return f"{r.state}: {' '.join(r.error.split())}"


def run_table(snap: RunSnapshot) -> Table:
    """One row per rank of a run: state (with the reason it failed), rates, step time, comm."""
    rows = tuple(
        Row((str(r.rank), _state_cell(r), str(r.steps), fmt_rate(r.steps_per_s),
             fmt_rate(r.samples_per_s), fmt_seconds(r.step_s), fmt_fraction(r.exposed_fraction),
             fmt_bytes_rate(r.bandwidth)),
            broken=r.state.broken)
        for r in snap.ranks)
    return Table(RUN_HEADER, rows)


def memory_table(snap: RunSnapshot) -> Optional[Table]:
    """What each rank holds (local shards of sharded tensors) and sends per step; None when no
    rank reported memory (no optimizer stepped)."""
    if not any(r.memory for r in snap.ranks):
        return None
    rows = []
    for r in snap.ranks:
        m = r.memory
        if m is None:
            rows.append(Row((str(r.rank), *("-",) * (len(MEMORY_HEADER) - 1)), r.state.broken))
            continue
        rows.append(Row((str(r.rank), fmt_bytes(m.params), fmt_bytes(m.grads),
                         fmt_bytes(m.optimizer), fmt_bytes(r.bytes_per_step), fmt_bytes(m.rss),
                         fmt_bytes(m.peak), fmt_bytes(m.device_peak)), r.state.broken))
    return Table(MEMORY_HEADER, tuple(rows))


def pipeline_table(snap: RunSnapshot) -> Optional[Table]:
    """Each rank's pipeline stage: time per microbatch, waits, and its bubble (idle share of a
    schedule step); None when no rank ran a pipeline schedule."""
    if not any(r.pipeline for r in snap.ranks):
        return None
    rows = []
    for r in snap.ranks:
        p = r.pipeline
        if p is None:
            rows.append(Row((str(r.rank), *("-",) * (len(PIPELINE_HEADER) - 1)), r.state.broken))
            continue
        rows.append(Row((str(r.rank), p.label, p.schedule, str(p.microbatches),
                         fmt_seconds(p.forward_s), fmt_seconds(p.backward_s),
                         fmt_seconds(p.p2p_wait_s), fmt_seconds(p.step_s),
                         fmt_fraction(p.bubble)), r.state.broken))
    return Table(PIPELINE_HEADER, tuple(rows))


def dims_table(snap: RunSnapshot) -> Optional[Table]:
    """Collectives by device-mesh dimension (``tp``, ``dp``...); None when none was named."""
    if not snap.dims:
        return None
    return Table(DIMS_HEADER, tuple(
        Row((d.dim, ", ".join(d.ops), str(d.calls), fmt_bytes(d.nbytes), fmt_seconds(d.seconds)))
        for d in snap.dims))


def comparison_table(runs: Sequence[RunFigures]) -> Table:
    """One row per named run: what each strategy costs and gives (a bubble column when any
    run is a pipeline)."""
    scalar_keys = sorted({k for r in runs for k in r.scalars})
    piped = any(r.bubble is not None for r in runs)
    header = ("run", "ranks", "samples/s", "step time", "exposed comm",
              *(("bubble",) if piped else ()), "comm/step", "params/rank", "grads/rank",
              "optimizer/rank", "peak RSS", *scalar_keys)
    rows = tuple(Row((r.name, str(r.ranks), fmt_rate(r.samples_per_s), fmt_seconds(r.step_s),
                      fmt_fraction(r.exposed_fraction),
                      *((fmt_fraction(r.bubble),) if piped else ()),
                      fmt_bytes(r.bytes_per_step),
                      fmt_bytes(r.params), fmt_bytes(r.grads), fmt_bytes(r.optimizer),
                      fmt_bytes(r.peak_rss),
                      *(f"{r.scalars[k]:.4g}" if k in r.scalars else "-" for k in scalar_keys)))
                 for r in runs)
    return Table(header, rows)
