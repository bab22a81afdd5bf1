"""Views of sessions and runs: text (baseline), static HTML, widgets. Never talks to engines.

The medium is chosen once per view: ``auto`` (widgets when ipywidgets is installed and a
Jupyter kernel is running, else text), ``widget`` or ``text``; the ``NBDIST_DISPLAY``
environment variable or :func:`set_display` overrides it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import Any, Callable, Optional

from .rank_output import OutputView
from .run_view import Dashboard, RunView
from .summary import register_formatters, show_summary
from .text import TextDashboard

__all__ = ["MODES", "Dashboard", "RunView", "display_medium", "end_cluster_views",
           "make_cluster_view", "make_run_view", "make_start_view", "set_display", "show_job",
           "widgets_available"]

MODES = ("auto", "widget", "text")
_mode: Optional[str] = None


def set_display(mode: Optional[str]) -> None:
    """Choose ``"auto"``, ``"widget"`` or ``"text"`` for later views (None: back to default)."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"display mode must be one of {', '.join(MODES)}, not {mode!r}")
    global _mode
    _mode = mode


def display_medium(mode: Optional[str] = None) -> str:
    """Resolve a mode to the medium used now: ``"widget"`` or ``"text"``."""
    mode = mode or os.environ.get("NBDIST_DISPLAY") or _mode or "auto"
    if mode not in MODES:
        raise ValueError(f"NBDIST_DISPLAY must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "text":
        return "text"
    if not widgets_available():
        return "text"  # "widget" without ipywidgets or a kernel degrades, it does not fail
    return "widget"


def widgets_available() -> bool:
    """ipywidgets importable and a Jupyter kernel (not terminal IPython) running."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return False  # asked first: finding a module's spec on disk costs every cell
    loaded = sys.modules.get("ipywidgets", False)
    if loaded is not False:  # imported already, or hidden with sys.modules[...] = None
        return loaded is not None
    try:
        return importlib.util.find_spec("ipywidgets") is not None
    except ValueError:
        return False


def make_run_view(output: str, shown_rank: int, world_size: int, *,
                  ranks: Optional[Sequence[int]] = None, mode: Optional[str] = None) -> RunView:
    """The view of one run, in the medium chosen for this notebook.

    ``output`` is ``rank0``, ``all`` or ``quiet`` (quiet: no output and no dashboard, but the
    run's telemetry is still recorded by the Session). It also makes sure IPython draws the
    run's snapshot (``Session.last_run``) as its HTML summary.
    """
    register_formatters()
    ranks = list(range(world_size)) if ranks is None else list(ranks)
    dashboard: Optional[Dashboard] = None
    widget = output != "quiet" and display_medium(mode) == "widget"
    if output != "quiet":
        if widget:
            from .widgets import WidgetDashboard

            dashboard = WidgetDashboard(ranks)
        else:
            dashboard = TextDashboard(show=show_summary)
    stream = OutputView(output, shown_rank=shown_rank, ranks=ranks, per_rank=widget)
    return RunView(stream, dashboard, world_size)


def make_start_view(mode: Optional[str] = None) -> Optional[Callable[[int, int], None]]:
    """What a start shows while its workers come up (``k of n ready``), called with
    ``(ready, wanted)``; None where nothing can be updated in place (text medium)."""
    from .start_view import start_progress

    return start_progress(display_medium(mode) == "widget")


def make_cluster_view(status: Callable[[], Any], scale: Optional[Callable[[int], Any]] = None,
                      mode: Optional[str] = None) -> Any:
    """A cluster panel widget with a Scale control that refreshes itself while shown (and
    says "stopped" once ``status`` raises NoClusterError), or the plain status where no
    widgets."""
    if display_medium(mode) == "widget":
        from .widgets import ClusterPanel

        return ClusterPanel(status, scale)
    return status()


def end_cluster_views() -> None:
    """The cluster stopped: each cluster panel shown says so, and its output becomes static
    (text and HTML, no widget), which a saved notebook shows whole."""
    panels = sys.modules.get(f"{__name__}.widgets")
    if panels is not None:  # else no panel was ever made
        panels.end_cluster_panels()


def show_job(header: Callable[[], str], snapshot: Callable[[], Any],
             ended: Callable[[], bool], ranks: Sequence[int], text: Callable[[], str],
             mode: Optional[str] = None, interval: float = 1.0) -> Any:
    """Show a watched job: a panel that refreshes itself every ``interval`` seconds while
    shown (and draws the job final once it ended), or where no widgets, ``text()`` printed.
    Returns the panel (None: printed)."""
    if display_medium(mode) == "widget":
        from IPython.display import display

        from .widgets import JobPanel

        panel = JobPanel(header, snapshot, ended, list(ranks), interval)
        display(panel)
        return panel
    print(text())
    return None
