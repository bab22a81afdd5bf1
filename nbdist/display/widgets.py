"""Widget views, composed from core ipywidgets: built once, then only their values change.

Nothing here runs a thread or prints: the run view is redrawn by its owner (from the kernel's
main thread, rate-limited), and the cluster panel's Scale button calls a function it was given.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Callable, Optional

import ipywidgets as W

from . import html as H
from .text import format_line, format_status, format_summary

_BAR_STYLE = {"running": "info", "done": "success", "failed": "danger", "stopped": "danger",
              "waiting": ""}


def _held(*widgets: W.Widget) -> ExitStack:
    """Hold every widget's sync so a redraw sends one message per widget, not per trait."""
    stack = ExitStack()
    for w in widgets:
        stack.enter_context(w.hold_sync())
    return stack


class _RankRow:
    def __init__(self, rank: int):
        self.label = W.HTML(f"<b>rank {rank}</b>", layout=W.Layout(width="60px"))
        self.bar = W.FloatProgress(value=0.0, min=0.0, max=1.0, bar_style="",
                                   layout=W.Layout(width="220px"))
        self.bar.add_class("nbdist-bar")
        self.bar.add_class(f"nbdist-rank-{rank}")
        self.stats = W.HTML("waiting")
        self.box = W.HBox([self.label, self.bar, self.stats])
        self.box.add_class("nbdist-rank-row")

    def show(self, r: Any) -> None:
        with _held(self.bar, self.stats):
            frac = r.bar.fraction if r.bar is not None else None
            if frac is not None:
                self.bar.value = frac
            elif r.state in ("done", "failed", "stopped"):
                self.bar.value = 1.0
            self.bar.bar_style = ("warning" if r.straggler and r.state == "running"
                                  else _BAR_STYLE.get(r.state, ""))
            self.bar.description = f"{frac:.0%}" if frac is not None else ""
            self.stats.value = H.rank_stats(r)


class RunWidget(W.VBox):
    """A run's dashboard: a bar per rank, latest scalars, step-time and bandwidth charts.

    Update it with :meth:`show` (a :class:`~nbdist.telemetry.aggregate.RunSnapshot`).
    """

    def __init__(self, ranks: list[int]):
        self.header = W.HTML("<b>nbdist</b> starting")
        self.rows = {r: _RankRow(r) for r in ranks}
        self.scalars = W.HTML("")
        self.chart = W.HTML("")
        self.chart.add_class("nbdist-chart")
        super().__init__([self.header, *(row.box for row in self.rows.values()), self.scalars,
                          self.chart])
        self.add_class("nbdist-dashboard")
        self.snapshot: Any = None

    def show(self, snap: Any, final: bool = False) -> None:
        self.snapshot = snap
        for r in snap.ranks:
            if r.rank not in self.rows:  # a rank outside the expected set reported
                self.rows[r.rank] = row = _RankRow(r.rank)
                self.children = (*self.children[:-2], row.box, *self.children[-2:])
            self.rows[r.rank].show(r)
        with _held(self.header, self.scalars, self.chart):
            state = "finished" if final and not snap.failed else (
                "failed" if snap.failed else "running")
            self.header.value = f"<b>nbdist</b> {state} · {H.escape(format_line(snap, ''))}"
            self.scalars.value = H.scalars_line(snap.scalars)
            self.chart.value = H.step_chart_svg(snap.series) + H.bandwidth_chart_svg(snap.series)


class WidgetDashboard:
    """Shows a :class:`RunWidget` under the cell when the first telemetry arrives.

    The display carries a static HTML summary next to the widget, refreshed at the end, so a
    saved notebook shows the table and chart where no widget state is stored (GitHub,
    nbviewer) while JupyterLab shows the live widget.
    """

    interval = 0.25

    def __init__(self, ranks: list[int]):
        self.widget = RunWidget(ranks)
        self._handle: Any = None

    def _bundle(self, snap: Any) -> dict[str, Any]:
        return {"application/vnd.jupyter.widget-view+json": {
                    "version_major": 2, "version_minor": 0, "model_id": self.widget.model_id},
                "text/html": H.run_summary(snap), "text/plain": format_summary(snap)}

    def update(self, snap: Any, final: bool = False) -> None:
        if not snap.has_telemetry and self._handle is None:
            return
        self.widget.show(snap, final)
        if self._handle is None:
            from IPython.display import display

            self._handle = display(self._bundle(snap), raw=True, display_id=True)

    def close(self, snap: Any) -> None:
        self.update(snap, final=True)
        if self._handle is not None:
            self._handle.update(self._bundle(snap), raw=True)


# ----------------------------------------------------------------- cluster panel
SCALE_NOTE = ("Scaling re-forms the process group at the new size before the next "
              "<code>%%distributed</code> cell. Rebuild what depends on the world size: "
              "DistributedDataParallel models, optimizers, samplers and data loaders. Workers "
              "that stay keep their namespace; new workers start empty (re-run set-up cells "
              "or <code>%nbdist push</code>).")


class ClusterPanel(W.VBox):
    """One row per worker and a control to scale to N workers.

    Parameters
    ----------
    status : callable
        Returns the current :class:`~nbdist.records.ClusterStatus`.
    scale : callable, optional
        ``scale(n)`` resizes the cluster (the same method ``%nbdist scale N`` calls).
    """

    def __init__(self, status: Callable[[], Any], scale: Optional[Callable[[int], Any]] = None):
        self._status = status
        self._scale = scale
        self.table = W.HTML("")
        self.table.add_class("nbdist-cluster-table")
        self.count = W.BoundedIntText(value=1, min=1, max=256, description="workers",
                                      layout=W.Layout(width="160px"))
        self.scale_button = W.Button(description="Scale", button_style="primary",
                                     disabled=scale is None, icon="arrows-h")
        self.scale_button.add_class("nbdist-scale")
        self.refresh_button = W.Button(description="Refresh", icon="refresh")
        self.message = W.HTML("")
        self.message.add_class("nbdist-cluster-message")
        self.scale_button.on_click(lambda _b: self.scale(self.count.value))
        self.refresh_button.on_click(lambda _b: self.refresh())
        super().__init__([self.table, W.HBox([self.count, self.scale_button,
                                              self.refresh_button]),
                          self.message, W.HTML(f"<small>{SCALE_NOTE}</small>")])
        self.add_class("nbdist-cluster")
        self.refresh()
        self.count.value = max(1, self.workers)

    @property
    def workers(self) -> int:
        return len(self.status.rows) if self.status is not None else 0

    def refresh(self) -> None:
        self.status = self._status()
        self.table.value = H.status_table(self.status)

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
            self.message.value = (f"<span style='color:#c00'>could not scale to {n}: "
                                  f"{H.escape(str(exc))}</span>")
        finally:
            self.scale_button.disabled = False

    def __repr__(self) -> str:
        return format_status(self.status) if self.status is not None else "<ClusterPanel>"
