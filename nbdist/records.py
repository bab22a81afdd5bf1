"""Plain records users hold: a cluster's status, a rank's displayed value, runs side by side.

Each record builds its own :class:`~nbdist.table_layout.Table` and draws it through the leaf
:mod:`nbdist.table_layout`, so the records never import the views.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from .table_layout import (
    Row,
    Table,
    comparison_html,
    html_table,
    status_html,
    status_text,
    text_table,
)
from .telemetry.units import fmt_bytes, fmt_fraction, fmt_rate, fmt_seconds

if TYPE_CHECKING:
    from .telemetry.compare import RunFigures

STATUS_HEADER = ("rank", "host", "pid", "device", "alive", "mem MiB", "state")


@dataclass(frozen=True)
class WorkerRow:
    """One worker in a :class:`ClusterStatus`."""

    rank: Optional[int]  # None: a worker outside the current rank plan
    worker: str  # the engine's id for it
    hostname: str
    pid: Optional[int]
    device: Optional[str]
    alive: bool
    rss_mb: Optional[float] = None  # resident memory in MiB
    #: "idle", "busy" (alive, no status reply: in a cell), "gone", or how it died in its
    #: error's words ("died: SIGKILL, last seen at line 7 of In [5]")
    state: str = "idle"


@dataclass(frozen=True)
class Held:
    """What the notebook keeps across cells, each store against its bound
    (``Session.held()``; ``docs/limits.md``, "What the notebook keeps").

    Sizes are in bytes; ``trace_events`` counts the telemetry events the kept runs hold for
    ``%nbdist timeline`` and ``compare``.
    """

    cells: int
    max_cells: int
    pushes: int
    push_bytes: int
    push_budget: int
    runs: int
    max_runs: int
    named: int
    max_named: int
    trace_events: int

    def __str__(self) -> str:
        return (f"history {self.cells} of {self.max_cells} cells, {self.pushes} pushes / "
                f"push copies {self.push_bytes / 2**20:.1f} MiB of "
                f"{self.push_budget / 2**20:.0f} MiB / runs {self.runs} of {self.max_runs} / "
                f"named runs {self.named} of {self.max_named} / traces {self.trace_events} "
                "events")


@dataclass(frozen=True)
class ClusterStatus:
    """What ``%nbdist status`` shows: wanted vs. observed workers, one row per worker, and
    what the notebook holds (``held``, when a session reports it)."""

    engine: str
    wanted: int
    rows: tuple[WorkerRow, ...] = field(default_factory=tuple)
    dist_backend: Optional[str] = None
    master: Optional[str] = None
    held: Optional[Held] = None

    @property
    def alive(self) -> int:
        return sum(r.alive for r in self.rows)

    def table(self) -> Table:
        """One row per worker (``NO`` for a dead worker: text has no red)."""
        rows = tuple(
            Row((_or_dash(w.rank), w.hostname, str(w.pid or "-"), w.device or "-",
                 "yes" if w.alive else "NO",
                 f"{w.rss_mb:.0f}" if w.rss_mb is not None else "-", w.state),
                broken=not w.alive)
            for w in self.rows)
        return Table(STATUS_HEADER, rows)

    def __repr__(self) -> str:
        return status_text(self.engine, self.alive, self.wanted, self.table(),
                           dist_backend=self.dist_backend, master=self.master,
                           held=str(self.held) if self.held else None)

    def _repr_html_(self) -> str:
        return status_html(self.engine, self.alive, self.wanted, self.table(),
                           dist_backend=self.dist_backend, master=self.master,
                           held=str(self.held) if self.held else None)


def _or_dash(value: Optional[object]) -> str:
    return "-" if value is None else str(value)


class RemoteValue:
    """The last expression of a ``%%distributed`` cell, as rank ``rank`` displayed it.

    Holds the display data only; use ``nbdist.pull(name)`` to bring the object itself back.
    """

    def __init__(self, rank: int, bundle: dict[str, Any]):
        self.rank = rank
        self.data = bundle

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return dict(self.data)

    def __repr__(self) -> str:
        return str(self.data.get("text/plain", ""))

    def _repr_html_(self) -> Optional[str]:
        if "text/html" not in self.data and any(k.startswith("image/") for k in self.data):
            return None  # an image (a figure as the value) shows as itself
        return self.data.get("text/html") or f"<pre>{html.escape(repr(self))}</pre>"


class Comparison:
    """Named runs side by side (``nbdist.compare()``, ``%nbdist compare``).

    ``runs`` holds one :class:`~nbdist.telemetry.compare.RunFigures` per run. It shows itself
    as an HTML table with a chart, and :meth:`to_pandas` gives the numbers as a DataFrame.
    """

    def __init__(self, runs: list[RunFigures]):
        self.runs = list(runs)

    def to_pandas(self) -> Any:
        """A DataFrame indexed by run name: numeric columns with units in their labels, the
        last logged values, then the run's verdicts (sentences, one per line). Raises
        ImportError without pandas."""
        import pandas as pd

        from .telemetry.compare import COLUMNS

        scalar_keys = sorted({k for r in self.runs for k in r.scalars})
        rows = [[*r.values(), *(r.scalars.get(k) for k in scalar_keys),
                 "\n".join(text for _, text in r.verdicts)] for r in self.runs]
        labels = [label for _attr, label, _scale in COLUMNS] + scalar_keys + ["verdicts"]
        frame = pd.DataFrame(rows, columns=labels, index=[r.name for r in self.runs])
        frame.index.name = "run"
        return frame

    def table(self) -> Table:
        """One row per named run: what each strategy costs and gives (a bubble column when
        any run is a pipeline), then the last logged values."""
        runs = self.runs
        scalar_keys = sorted({k for r in runs for k in r.scalars})
        piped = any(r.bubble is not None for r in runs)
        header = ("run", "ranks", "samples/s", "step time", "exposed comm",
                  *(("bubble",) if piped else ()), "comm/step", "params/rank", "grads/rank",
                  "optimizer/rank", "peak RSS", *scalar_keys, "verdicts")
        rows = tuple(Row((r.name, str(r.ranks), fmt_rate(r.samples_per_s), fmt_seconds(r.step_s),
                          fmt_fraction(r.exposed_fraction),
                          *((fmt_fraction(r.bubble),) if piped else ()),
                          fmt_bytes(r.bytes_per_step),
                          fmt_bytes(r.params), fmt_bytes(r.grads), fmt_bytes(r.optimizer),
                          fmt_bytes(r.peak_rss),
                          *(f"{r.scalars[k]:.4g}" if k in r.scalars else "-"
                            for k in scalar_keys),
                          ", ".join(rule for rule, _ in r.verdicts) or "-"))
                     for r in runs)
        return Table(header, rows)

    def verdict_lines(self) -> list[str]:
        """Each run's verdicts in full, ``run: sentence``; the table names their rules."""
        return [f"{r.name}: {text}" for r in self.runs for _, text in r.verdicts]

    def __repr__(self) -> str:
        if not self.runs:
            return "no named runs"
        said = self.verdict_lines()
        return "\n".join(text_table(self.table()) + ([""] + said if said else []))

    def _repr_html_(self) -> str:
        throughput = [(r.name, r.samples_per_s, fmt_rate(r.samples_per_s))
                      for r in self.runs if r.samples_per_s]
        held = []  # what one rank holds for training
        for r in self.runs:
            if r.params is not None:
                nbytes = float(r.params + (r.grads or 0) + (r.optimizer or 0))
                held.append((r.name, nbytes, fmt_bytes(nbytes)))
        return comparison_html(self.table(), throughput, held, self.verdict_lines())


@dataclass(frozen=True)
class TrialRow:
    """One setting in a :class:`TuneResult`: its figures pooled over its trials' timed steps
    (``spread_s``: their interquartile range), or in ``note`` why it has none."""

    setting: str
    samples_per_s: Optional[float] = None
    step_s: Optional[float] = None
    spread_s: Optional[float] = None
    exposed_fraction: Optional[float] = None
    bytes_per_step: Optional[float] = None
    peak_memory: Optional[int] = None
    trials: int = 0
    steps: int = 0
    bucket_cap_mb: Optional[float] = None  # the bucket size its DDP model got
    lossy: bool = False  # a compression hook: the gradients change
    note: str = ""


#: a tuning table's numeric columns: attribute -> (column label with its unit, scale)
TRIAL_COLUMNS: dict[str, tuple[str, float]] = {
    "samples_per_s": ("samples/s", 1), "step_s": ("step time (ms)", 1e3),
    "spread_s": ("spread IQR (ms)", 1e3), "exposed_fraction": ("exposed comm (%)", 100),
    "bytes_per_step": ("comm/step (MB)", 1e-6), "peak_memory": ("peak memory (MB)", 1e-6),
    "bucket_cap_mb": ("bucket_cap_mb", 1), "trials": ("trials", 1),
    "steps": ("steps timed", 1)}


class TuneResult:
    """What ``%%distributed --tune`` measured: one row per setting, fastest first (the
    settings that failed or were skipped last), and the one it chose.

    Shows itself as a table (text and HTML); :meth:`to_pandas` gives a DataFrame.
    """

    def __init__(self, rows: list[TrialRow], *, chosen: str, speedup: Optional[float],
                 steps: int, trials: int) -> None:
        self.rows = list(rows)
        self.chosen = chosen  # the chosen setting's label ("torch's defaults": none beat them)
        self.speedup = speedup  # its samples/s over torch's defaults' (None: not chosen)
        self.steps = steps  # optimizer steps per trial
        self.trials = trials  # cell runs

    def _note(self, r: TrialRow) -> str:
        return ", ".join(x for x in ("chosen" if r.setting == self.chosen else "",
                                     "lossy" if r.lossy else "", r.note) if x)

    def to_pandas(self) -> Any:
        """A DataFrame indexed by setting: the numeric columns, then a note (chosen, lossy,
        failed or skipped and why). Raises ImportError without pandas."""
        import pandas as pd

        rows = [[None if getattr(r, attr) is None else getattr(r, attr) * scale
                 for attr, (_label, scale) in TRIAL_COLUMNS.items()] + [self._note(r)]
                for r in self.rows]
        labels = [label for label, _scale in TRIAL_COLUMNS.values()]
        frame = pd.DataFrame(rows, columns=labels + ["note"],
                             index=[r.setting for r in self.rows])
        frame.index.name = "setting"
        return frame

    def headline(self) -> str:
        gain = f", {self.speedup:.2f}x torch's defaults' samples/s" if self.speedup else ""
        return (f"nbdist --tune: chose {self.chosen}{gain} ({self.trials} trials of "
                f"{self.steps} optimizer steps, fastest first)")

    def table(self) -> Table:
        header = ("setting", "samples/s", "step time", "spread (IQR)", "exposed comm", "comm/step",
                  "peak memory", "bucket", "trials", "note")
        return Table(header, tuple(
            Row((r.setting, fmt_rate(r.samples_per_s), fmt_seconds(r.step_s),
                 fmt_seconds(r.spread_s),
                 fmt_fraction(r.exposed_fraction), fmt_bytes(r.bytes_per_step),
                 fmt_bytes(r.peak_memory),
                 f"{r.bucket_cap_mb:g} MiB" if r.bucket_cap_mb is not None else "-",
                 str(r.trials), self._note(r)), broken=r.note.startswith("failed"))
            for r in self.rows))

    def __repr__(self) -> str:
        return "\n".join([self.headline(), *text_table(self.table())])

    def _repr_html_(self) -> str:
        return (f"<div class='nbdist-tune'><div style='margin-bottom:4px'>"
                f"{html.escape(self.headline())}</div>{html_table(self.table())}</div>")
