"""Widget views, composed from core ipywidgets: built once, then only their values change.

The run view is redrawn by its owner (from the kernel's main thread, rate-limited). The
cluster panel and a watched job's panel refresh themselves while they are shown. The cluster
panel's timer is a coroutine on the kernel's own event loop (the loop ipykernel runs on the
main thread), which wakes every few seconds and calls the status function it was given: the
status call never runs beside a cell (the loop only turns while the kernel is idle), and
ipyparallel's and Dask's clients are only ever used from the main thread. A watched job's
numbers come from the collector, which any thread may read, so its panel's timer is a thread
of its own and the panel follows the job also while other cells run (widget messages may be
sent from any thread of the kernel). Markup comes from :mod:`nbdist.display.html`, tables and
colours from :mod:`nbdist.table_layout`.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import weakref
from contextlib import ExitStack
from html import escape as html_escape
from typing import TYPE_CHECKING, Any, Callable, Optional

from ipywidgets import HTML, BoundedIntText, Button, HBox, Layout, VBox, Widget

from ..errors import NoClusterError
from .html import (
    SCALE_NOTE,
    charts,
    cluster_stopped,
    detail_tables,
    error_text,
    failures,
    legend,
    message,
    refreshed_note,
    run_header,
    run_table_html,
    stall,
    verdicts,
)
from .summary import summary_bundle

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

if TYPE_CHECKING:
    from IPython.display import DisplayHandle

    from ..records import ClusterStatus
    from ..telemetry.snapshot import RunSnapshot


def _held(*views: Widget) -> ExitStack:
    """Hold every widget's sync so a redraw sends one message per widget, not per trait."""
    stack = ExitStack()
    for view in views:
        stack.enter_context(view.hold_sync())
    return stack


def _set(view: HTML, value: str) -> None:
    if view.value != value:  # an unchanged part sends nothing to the front end
        view.value = value


class RunWidget(VBox):
    """A run's dashboard: a header, one aligned row per rank (or min / median / max rows and
    the outliers above 16 ranks), a legend, and charts of step time, bandwidth and logged values.

    Update it with :meth:`show` (a :class:`~nbdist.telemetry.aggregate.RunSnapshot`).
    """

    def __init__(self, ranks: list[int]):
        self.ranks = list(ranks)
        self.header = HTML("<b>nbdist</b> starting")
        self.stall = HTML("")  # the hang doctor's verdict, while the run is stalled
        self.stall.add_class("nbdist-stall-box")
        self.table = HTML("")
        self.table.add_class("nbdist-rows")
        self.memory = HTML("")  # pipeline stages, mesh dimensions, what each rank holds
        self.memory.add_class("nbdist-memory")
        self.failures = HTML("")
        self.verdicts = HTML("")  # what the numbers mean, once the run is over
        self.legend = HTML("")
        self.chart = HTML("")
        self.chart.add_class("nbdist-chart")
        super().__init__([self.header, self.stall, self.table, self.memory, self.verdicts,
                          self.failures, self.legend, self.chart])
        self.add_class("nbdist-dashboard")
        #: the final snapshot once the run is over (live ones are not kept: a thousand
        #: ranks' records held from one redraw to the next would keep the garbage collector
        #: busy)
        self.snapshot: Optional[RunSnapshot] = None
        self._drawn: dict[str, tuple] = {}  # part -> (values, records) it was last drawn from

    def show(self, snap: RunSnapshot, final: bool = False) -> None:
        """Draw ``snap``; ``final`` when the run is over (the header then says finished).

        Parts whose numbers did not change since the last redraw are not built again (the
        fold hands over the same record objects while they do not change).
        """
        self.snapshot = snap if final else None
        numbers = snap.has_telemetry  # else a header alone: the run's clock, what happened
        with _held(self.header, self.stall, self.table, self.memory, self.verdicts,
                   self.failures, self.legend, self.chart):
            _set(self.header, run_header(snap, final))
            _set(self.stall, stall(snap))
            _set(self.table, run_table_html(snap) if numbers else "")
            _set(self.legend, legend() if numbers else "")
            if self._changed("details", (snap.dims, *((r.bytes_per_step, r.state)
                                                      for r in snap.ranks)),
                             [x for r in snap.ranks for x in (r.memory, r.pipeline)]):
                _set(self.memory, detail_tables(snap))
            _set(self.verdicts, verdicts(snap))
            _set(self.failures, failures(snap))
            if self._changed("charts", (len(snap.series),),
                             [snap.series[-1] if snap.series else None,
                              *(c for by_rank in snap.scalar_series.values()
                                for c in by_rank.values())]):
                _set(self.chart, charts(snap))

    def _changed(self, part: str, values: tuple, records: list) -> bool:
        """True (and remembered) unless ``values`` are equal and ``records`` the very same
        objects as when ``part`` was last drawn."""
        last = self._drawn.get(part)
        if (last is not None and last[0] == values and len(last[1]) == len(records)
                and all(a is b for a, b in zip(last[1], records))):
            return False
        self._drawn[part] = (values, records)
        return True


class WidgetDashboard:
    """Shows a :class:`RunWidget` under the cell when the first telemetry arrives.

    While the run goes on, the display carries the static summary (:func:`.summary_bundle`)
    next to the widget, for a viewer that draws no widgets; when it ends, the display is
    replaced by that summary alone: a widget in a saved notebook reads "model not found" in
    a fresh session.
    """

    interval: float = 0.25

    def __init__(self, ranks: list[int]):
        self.widget = RunWidget(ranks)
        self._handle: Optional[DisplayHandle] = None

    def _bundle(self, snap: RunSnapshot) -> dict[str, Any]:
        return {**self.widget._repr_mimebundle_(), **summary_bundle(snap)}

    def _draw(self, snap: RunSnapshot, final: bool) -> None:
        if not snap.has_news and self._handle is None:
            return  # nothing to show yet: no empty dashboard under quick cells that log nothing
        self.widget.show(snap, final)
        if self._handle is None:
            from IPython.display import display  # deferred: only a live kernel draws widgets

            self._handle = display(self._bundle(snap), raw=True, display_id=True)

    def update(self, snap: RunSnapshot) -> None:
        self._draw(snap, final=False)

    def close(self, snap: RunSnapshot) -> None:
        """The final redraw: the output becomes the static summary, with no widget left in
        it, so that the saved notebook shows the run whole in a fresh session (where no
        widget model exists), trusted or not, and in any viewer."""
        shown = self._handle is not None
        self._draw(snap, final=True)
        if shown and self._handle is not None:
            self._handle.update(summary_bundle(snap), raw=True)


# ----------------------------------------------------------------- panels
class _ShownPanel(VBox):
    """A panel that calls its :meth:`refresh` every ``interval`` seconds while a view of it
    is shown, on the kernel's own event loop (the loop only turns while the kernel is idle),
    or, with :attr:`BESIDE_CELLS`, on a thread of its own (also while cells run); either way
    at most :attr:`MAX_BUSY_SHARE` of the time. ``interval`` None: on demand only."""

    #: a refresh may take at most this share of the kernel's time: a slow one spaces the
    #: refreshes out instead of hogging the kernel
    MAX_BUSY_SHARE = 0.2
    #: refresh from a thread of the panel's own, also while other cells run: for a panel
    #: whose :meth:`refresh` is safe on any thread (it reads no engine's client)
    BESIDE_CELLS = False

    def __init__(self, children: list[Widget], interval: Optional[float]):
        self.interval = interval
        self.refreshes = 0
        self._task: Optional[asyncio.Task] = None
        self._closed = False
        self._last_cost = 0.0
        self._beside = False  # the refreshing thread runs (BESIDE_CELLS)
        self._beside_lock = threading.Lock()
        self._wake = threading.Event()  # set on close: the thread stops waiting
        self._outputs: list[DisplayHandle] = []  # the outputs that show this panel
        self._static = False  # the outputs hold the static bundle: the panel's view ended
        self._outputs_lock = threading.Lock()  # the panel's thread may end them as one shows
        super().__init__(children)

    def refresh(self) -> None:
        raise NotImplementedError

    def static_bundle(self) -> dict[str, str]:
        """The panel as it is now, with no widget: text and sanitizer-safe HTML."""
        raise NotImplementedError

    def _ipython_display_(self) -> None:
        """Show the panel as an output of its own, by display id: the widget's view with
        :meth:`static_bundle` beside it (for a frontend that draws no widgets), or, once the
        panel's view has ended, the static bundle alone."""
        from IPython.display import display  # deferred: only a live kernel shows panels

        with self._outputs_lock:
            bundle = self.static_bundle()
            if not self._static:
                bundle = {**self._repr_mimebundle_(), **bundle}
            handle = display(bundle, raw=True, display_id=True)
            if handle is not None and not self._static:
                self._outputs.append(handle)

    def _end_outputs(self) -> None:
        """Replace every output of the panel with its static bundle (once): a widget in a
        saved notebook reads "model not found" in a fresh session, where no model exists."""
        with self._outputs_lock:
            if self._static:
                return
            self._static = True
            if self._outputs:
                bundle = self.static_bundle()
                for handle in self._outputs:
                    handle.update(bundle, raw=True)

    def _watch_views(self) -> None:
        if self.interval:
            # Count the front end's views of the panel: it refreshes only while one is shown.
            self._view_count = 0
            self.observe(self._on_views, names="_view_count")

    def _on_views(self, change: dict[str, Any]) -> None:
        if self.BESIDE_CELLS:
            if change["new"]:
                self._start_beside()
            return
        if change["new"] and self._task is None and not self._closed:
            try:
                loop = asyncio.get_running_loop()  # the kernel's, while it handles a message
            except RuntimeError:
                return  # no event loop on this thread (plain Python): refresh on demand
            self._task = loop.create_task(self._tick())

    def _delay(self) -> float:
        return max(self.interval or 0.0, self._last_cost / self.MAX_BUSY_SHARE)

    def _start_beside(self) -> None:
        with self._beside_lock:
            if self._beside or self._closed or not self.interval:
                return
            self._beside = True
        threading.Thread(target=self._run_beside, name="nbdist-panel", daemon=True).start()

    def _run_beside(self) -> None:
        """Refresh every ``interval`` seconds while a view of the panel exists, whatever
        the kernel's main thread is doing."""
        try:
            while not self._closed and self._view_count and self.interval:
                if self._wake.wait(self._delay()) or self._closed or not self._view_count:
                    break
                self.refresh()
        except Exception as exc:  # a thread has no cell to raise into: say so, and stop
            sys.__stderr__.write(f"nbdist: the panel stopped refreshing: {exc!r}\n")
            self.interval = None
        finally:
            with self._beside_lock:
                self._beside = False
        if self._view_count and not self._closed and self.interval:
            self._start_beside()  # a view came back while this thread was leaving

    async def _tick(self) -> None:
        """Refresh every ``interval`` seconds while a view of the panel exists."""
        try:
            while not self._closed and self._view_count and self.interval:
                await asyncio.sleep(self._delay())
                if self._closed or not self._view_count:
                    break
                self.refresh()
        finally:
            self._task = None

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
        super().close()


class JobPanel(_ShownPanel):
    """A watched job's dashboard (``%nbdist job ID show``): its record's line over the run's
    widget, refreshed while shown, by a thread of its own, so also while other cells run
    (the callables read the collector, which any thread may); once the job has ended (or is
    no longer watched), one last refresh draws it final and its output becomes the job's
    static summary (:meth:`static_bundle`), which a saved notebook shows whole.

    Parameters
    ----------
    header : callable
        The job's record as one line.
    snapshot : callable
        The job's run now (None: no rank has reported yet).
    ended : callable
        True once the job is over.
    ranks : list of int
        The job's ranks.
    interval : float, optional
        Seconds between refreshes while shown (None: only on demand); more where a redraw
        takes over :attr:`MAX_BUSY_SHARE` of that.
    """

    def __init__(self, header: Callable[[], str],
                 snapshot: Callable[[], Optional[RunSnapshot]], ended: Callable[[], bool],
                 ranks: list[int], interval: Optional[float] = 1.0):
        self._header, self._snapshot, self._ended = header, snapshot, ended
        self.head = HTML("")
        self.head.add_class("nbdist-job")
        self.run = RunWidget(ranks)
        self._drawing = threading.Lock()  # the panel's thread, or a call from a cell
        self._drawn: tuple[str, Optional[RunSnapshot]] = ("", None)  # header, snapshot
        super().__init__([self.head, self.run], interval)
        self.refresh()
        self._watch_views()

    BESIDE_CELLS = True
    #: it redraws beside the user's cells, on the kernel's interpreter: a job of a thousand
    #: ranks (35 ms a redraw) is redrawn every 2 s or so rather than every second
    MAX_BUSY_SHARE = 0.02

    def refresh(self) -> None:
        """Draw the job now; once it has ended, draw it final and stop refreshing."""
        with self._drawing:
            self._draw()

    def _draw(self) -> None:
        # its thread's CPU, not the wall clock: waiting for the collector's fold to let go
        # of the jobs costs the kernel nothing
        t0 = time.thread_time()
        done = self._ended()
        snap = self._snapshot()
        header = self._header()
        self._drawn = (header, snap)
        _set(self.head, f"<b>nbdist</b> {html_escape(header)}")
        if snap is not None:
            self.run.show(snap, final=done)
        if done:
            self.interval = None
            self._end_outputs()
        self._last_cost = time.thread_time() - t0
        self.refreshes += 1

    def static_bundle(self) -> dict[str, str]:
        """The job as last drawn, with no widget: its record's line over the run's summary
        (text and HTML, the charts as images)."""
        header, snap = self._drawn
        head = f"<div class='nbdist-job'><b>nbdist</b> {html_escape(header)}</div>"
        if snap is None:
            return {"text/plain": f"nbdist {header}", "text/html": head}
        summary = summary_bundle(snap)
        return {"text/plain": f"nbdist {header}\n{summary['text/plain']}",
                "text/html": head + summary["text/html"]}

    def __repr__(self) -> str:
        return f"nbdist {self._header()}"


class ClusterPanel(_ShownPanel):
    """One row per worker, a control to scale to N workers, refreshed while shown.

    Parameters
    ----------
    status : callable
        Returns the current :class:`~nbdist.records.ClusterStatus`; raises
        :class:`~nbdist.errors.NoClusterError` once the cluster is stopped.
    scale : callable, optional
        ``scale(n)`` resizes the cluster (the same method ``%nbdist scale N`` calls).
    interval : float, optional
        Seconds between refreshes while the panel is on screen (None: only on demand).
    """

    def __init__(self, status: Callable[[], ClusterStatus],
                 scale: Optional[Callable[[int], object]] = None,
                 interval: Optional[float] = 3.0, clock: Callable[[], float] = time.time):
        self._status = status
        self._scale = scale
        self._clock = clock
        self.status: Optional[ClusterStatus] = None
        self.stopped = False
        self._seen: Optional[ClusterStatus] = None  # the last status (kept once stopped)
        self._why = ""  # why the cluster reads stopped
        self._updated = ""  # the clock at the last refresh
        self.table = HTML("")
        self.table.add_class("nbdist-cluster-table")
        self.note = HTML("")
        self.note.add_class("nbdist-cluster-note")
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
        super().__init__([self.table, self.note,
                          HBox([self.count, self.scale_button, self.refresh_button]),
                          self.message, HTML(SCALE_NOTE)], interval)
        self.add_class("nbdist-cluster")
        self._shown_workers = self.count.value  # the size the Scale box last followed
        self.refresh()
        self._watch_views()

    @property
    def workers(self) -> int:
        return len(self.status.rows) if self.status is not None else 0

    def refresh(self) -> None:
        """Ask for the status now; a stopped cluster or an error is shown on the panel."""
        t0 = time.perf_counter()
        error = ""
        try:
            self.status = self._status()
            self.stopped = False
        except NoClusterError as exc:
            self.status, self.stopped = None, True
            error = self._why = str(exc)
        except Exception as exc:  # shown, not raised: a timer has no cell to raise into
            error = f"{type(exc).__name__}: {exc}"
        self._last_cost = time.perf_counter() - t0
        self.refreshes += 1
        clock = self._updated = time.strftime("%H:%M:%S", time.localtime(self._clock()))
        self._seen = self.status or self._seen
        with _held(self.table, self.note, self.message, self.scale_button):
            if self.stopped:
                _set(self.table, cluster_stopped(error))
                _set(self.note, refreshed_note(self.interval, clock))
                _set(self.message, "")  # what the last Scale said is no longer true
            else:
                if self.status is not None:
                    _set(self.table, self.status._repr_html_())
                _set(self.note, refreshed_note(self.interval, clock, error))
                self._follow()
            self.scale_button.disabled = self._scale is None or self.stopped

    def _follow(self) -> None:
        """The Scale box says the size of the cluster shown (one click must not shrink it),
        unless someone typed another number since the box last followed it."""
        n = self.workers
        if n and n != self._shown_workers and self.count.value == self._shown_workers:
            self.count.value = min(max(1, n), self.count.max)
        self._shown_workers = n or self._shown_workers

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
            self.refresh()  # the table says what the cluster is now, the message why
            self.message.value = error_text(f"could not scale to {n}: {exc}")
        finally:
            self.scale_button.disabled = self._scale is None or self.stopped

    def static_bundle(self) -> dict[str, str]:
        """The cluster as last seen, with no widget: its table, and whether it stopped."""
        # The same classes as the widget's parts: the static form reads as the panel it
        # replaces, and, as the widget does, a stopped cluster's table says stopped (its last
        # workers' rows follow, named as the last seen, never as alive now).
        text, table, seen = [], "", ""
        if self.stopped:
            text.append(f"nbdist cluster: stopped: {self._why}")
            table = cluster_stopped(self._why)
            if self._seen is not None:
                text.append("last seen:\n" + repr(self._seen))
                seen = ("<details class='nbdist-cluster-last'><summary>last seen</summary>"
                        f"{self._seen._repr_html_()}</details>")
        elif self._seen is not None:
            text.append(repr(self._seen))
            table = self._seen._repr_html_()
        now = "" if self.stopped else "; `%nbdist cluster` shows the cluster now"
        text.append(f"as of {self._updated}{now}")
        html = (f"<div class='nbdist-cluster-table'>{table}</div>{seen}"
                f"<div class='nbdist-cluster-note'><small>as of {html_escape(self._updated)}"
                f"{message(now)}</small></div>")
        return {"text/plain": "\n".join(text),
                "text/html": "<div class='nbdist-cluster'>" + html + "</div>"}

    def _ipython_display_(self) -> None:
        """Show the panel; the panels shown before it stay as they last were, static."""
        for older in list(_SHOWN_CLUSTER_PANELS):
            older.close()
        super()._ipython_display_()
        if not self._static:
            _SHOWN_CLUSTER_PANELS.add(self)

    def close(self) -> None:
        """Stop refreshing; the panel's outputs become its static bundle."""
        self._end_outputs()
        _SHOWN_CLUSTER_PANELS.discard(self)
        super().close()

    def __repr__(self) -> str:
        if self.stopped:
            return "nbdist cluster: stopped"
        return repr(self.status) if self.status is not None else "<ClusterPanel>"


#: the cluster panels whose outputs are live widget views
_SHOWN_CLUSTER_PANELS: weakref.WeakSet[ClusterPanel] = weakref.WeakSet()


def end_cluster_panels() -> None:
    """The cluster stopped: each shown cluster panel draws that and becomes static."""
    for panel in list(_SHOWN_CLUSTER_PANELS):
        panel.refresh()
        panel.close()


__all__ = ["ClusterPanel", "JobPanel", "RunWidget", "WidgetDashboard", "end_cluster_panels",
           "message"]
