"""Widget views, composed from core ipywidgets: built once, then only their values change.

Nothing here runs a thread or prints: the run view is redrawn by its owner (from the kernel's
main thread, rate-limited), and the cluster panel's Scale button calls a function it was given.
Markup and colours come from :mod:`nbdist.display.html`.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Callable, Optional

from ipywidgets import HTML, BoundedIntText, Button, FloatProgress, HBox, Layout, VBox, Widget

from ..telemetry.states import RankState
from .html import (
    SCALE_NOTE,
    bold,
    charts,
    error_text,
    rank_stats,
    run_header,
    run_summary,
    scalars_line,
    status_table,
)
from .text import format_line, format_status, format_summary

if TYPE_CHECKING:
    from IPython.display import DisplayHandle

    from ..records import ClusterStatus
    from ..telemetry.aggregate import RankSnapshot, RunSnapshot

#: a rank's progress-bar style by state (a running straggler is drawn as a warning)
_BAR_STYLE = {RankState.WAITING: "", RankState.RUNNING: "info", RankState.DONE: "success",
              RankState.FAILED: "danger", RankState.STOPPED: "danger"}


def _held(*views: Widget) -> ExitStack:
    """Hold every widget's sync so a redraw sends one message per widget, not per trait."""
    stack = ExitStack()
    for view in views:
        stack.enter_context(view.hold_sync())
    return stack


class _RankRow:
    def __init__(self, rank: int):
        self.label = HTML(bold(f"rank {rank}"), layout=Layout(width="60px"))
        self.bar = FloatProgress(value=0.0, min=0.0, max=1.0, bar_style="",
                                 layout=Layout(width="220px"))
        self.bar.add_class("nbdist-bar")
        self.bar.add_class(f"nbdist-rank-{rank}")
        self.stats = HTML("waiting")
        self.box = HBox([self.label, self.bar, self.stats])
        self.box.add_class("nbdist-rank-row")

    def show(self, r: RankSnapshot) -> None:
        with _held(self.bar, self.stats):
            frac = r.bar.fraction if r.bar is not None else None
            if frac is not None:
                self.bar.value = frac
            elif not r.state.active:
                self.bar.value = 1.0
            self.bar.bar_style = ("warning" if r.straggler and r.state == RankState.RUNNING
                                  else _BAR_STYLE.get(r.state, ""))
            self.bar.description = f"{frac:.0%}" if frac is not None else ""
            self.stats.value = rank_stats(r)


class RunWidget(VBox):
    """A run's dashboard: a bar per rank, latest scalars, step-time and bandwidth charts.

    Update it with :meth:`show` (a :class:`~nbdist.telemetry.aggregate.RunSnapshot`).
    """

    def __init__(self, ranks: list[int]):
        self.header = HTML(run_header("starting"))
        self.rows = {r: _RankRow(r) for r in ranks}
        self.scalars = HTML("")
        self.chart = HTML("")
        self.chart.add_class("nbdist-chart")
        super().__init__([self.header, *(row.box for row in self.rows.values()), self.scalars,
                          self.chart])
        self.add_class("nbdist-dashboard")
        self.snapshot: Optional[RunSnapshot] = None

    def show(self, snap: RunSnapshot, final: bool = False) -> None:
        """Draw ``snap``; ``final`` when the run is over (the header then says finished)."""
        self.snapshot = snap
        for r in snap.ranks:
            if r.rank not in self.rows:  # a rank outside the expected set reported
                self.rows[r.rank] = row = _RankRow(r.rank)
                self.children = (*self.children[:-2], row.box, *self.children[-2:])
            self.rows[r.rank].show(r)
        with _held(self.header, self.scalars, self.chart):
            state = "finished" if final and not snap.failed else (
                "failed" if snap.failed else "running")
            self.header.value = run_header(state, format_line(snap, ""))
            self.scalars.value = scalars_line(snap.scalars)
            self.chart.value = charts(snap.series)


class WidgetDashboard:
    """Shows a :class:`RunWidget` under the cell when the first telemetry arrives.

    The display carries a static HTML summary next to the widget, refreshed at the end, so a
    saved notebook shows the table and chart where no widget state is stored (GitHub,
    nbviewer) while JupyterLab shows the live widget.
    """

    interval: float = 0.25

    def __init__(self, ranks: list[int]):
        self.widget = RunWidget(ranks)
        self._handle: Optional[DisplayHandle] = None

    def _bundle(self, snap: RunSnapshot) -> dict[str, Any]:
        return {**self.widget._repr_mimebundle_(),
                "text/html": run_summary(snap), "text/plain": format_summary(snap)}

    def _draw(self, snap: RunSnapshot, final: bool) -> None:
        if not snap.has_telemetry and self._handle is None:
            return  # nothing to show yet: no empty dashboard under cells that log nothing
        self.widget.show(snap, final)
        if self._handle is None:
            from IPython.display import display  # deferred: only a live kernel draws widgets

            self._handle = display(self._bundle(snap), raw=True, display_id=True)

    def update(self, snap: RunSnapshot) -> None:
        self._draw(snap, final=False)

    def close(self, snap: RunSnapshot) -> None:
        """The final redraw, and the saved summary brought up to date with it."""
        shown = self._handle is not None
        self._draw(snap, final=True)
        if shown and self._handle is not None:
            self._handle.update(self._bundle(snap), raw=True)


# ----------------------------------------------------------------- cluster panel
class ClusterPanel(VBox):
    """One row per worker and a control to scale to N workers.

    Parameters
    ----------
    status : callable
        Returns the current :class:`~nbdist.records.ClusterStatus`.
    scale : callable, optional
        ``scale(n)`` resizes the cluster (the same method ``%nbdist scale N`` calls).
    """

    def __init__(self, status: Callable[[], ClusterStatus],
                 scale: Optional[Callable[[int], object]] = None):
        self._status = status
        self._scale = scale
        self.status: Optional[ClusterStatus] = None
        self.table = HTML("")
        self.table.add_class("nbdist-cluster-table")
        self.count = BoundedIntText(value=1, min=1, max=256, description="workers",
                                    layout=Layout(width="160px"))
        self.scale_button = Button(description="Scale", button_style="primary",
                                   disabled=scale is None, icon="arrows-h")
        self.scale_button.add_class("nbdist-scale")
        self.refresh_button = Button(description="Refresh", icon="refresh")
        self.message = HTML("")
        self.message.add_class("nbdist-cluster-message")
        self.scale_button.on_click(lambda _b: self.scale(self.count.value))
        self.refresh_button.on_click(lambda _b: self.refresh())
        super().__init__([self.table, HBox([self.count, self.scale_button, self.refresh_button]),
                          self.message, HTML(SCALE_NOTE)])
        self.add_class("nbdist-cluster")
        self.refresh()
        self.count.value = max(1, self.workers)

    @property
    def workers(self) -> int:
        return len(self.status.rows) if self.status is not None else 0

    def refresh(self) -> None:
        self.status = self._status()
        self.table.value = status_table(self.status)

    def scale(self, n: int) -> None:
        """Resize to ``n`` workers; errors stay on the panel in red."""
        if self._scale is None:
            return
        with _held(self.message, self.scale_button):
            self.message.value = f"scaling to {n} workers…"
            self.scale_button.disabled = True
        try:
            self._scale(n)
            self.refresh()
            self.message.value = (f"{self.workers} workers; the process group was re-formed "
                                  f"(world size {n}).")
        except Exception as exc:  # shown, not raised: a button has no cell to raise into
            self.message.value = error_text(f"could not scale to {n}: {exc}")
        finally:
            self.scale_button.disabled = False

    def __repr__(self) -> str:
        return format_status(self.status) if self.status is not None else "<ClusterPanel>"
