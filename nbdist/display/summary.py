"""A run's summary in both media at once: the text table (:mod:`.text`) and the static HTML
(:mod:`.html`), composed here so that each of those keeps to its own medium.

Also how IPython shows a :class:`~nbdist.telemetry.snapshot.RunSnapshot` (what
``Session.last_run`` returns) as the last expression of a cell: the snapshot is a pure record
of numbers that imports no view, so the display layer tells IPython how to draw it
(:func:`register_formatters`), as it makes each run's view: before the session holds a
snapshot to hand out.
"""

from __future__ import annotations

from typing import Any, Optional

from ..telemetry.run import Run
from ..telemetry.snapshot import RunSnapshot
from .html import run_summary
from .text import format_summary


def summary_bundle(snap: RunSnapshot, notes: bool = True) -> dict[str, str]:
    """The summary as a MIME bundle: the plain table (with the run's notes unless they were
    printed already) and the static HTML."""
    return {"text/plain": format_summary(snap, notes), "text/html": run_summary(snap)}


def _shell() -> Optional[Any]:
    try:  # deferred: the text view also serves plain Python, without IPython
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def show_summary(snap: RunSnapshot) -> bool:
    """Show the summary as one rich output under IPython; False when no IPython runs."""
    if _shell() is None:
        return False
    from IPython.display import display

    display(summary_bundle(snap, notes=False), raw=True)  # the text view printed them
    return True


def register_formatters() -> None:
    """Have IPython's HTML formatter draw a run's snapshot (and a run, by its snapshot) as the
    static summary; its text form stays the record's own ``__repr__``. Harmless to repeat,
    and does nothing without IPython."""
    shell = _shell()
    if shell is None:
        return
    html = shell.display_formatter.formatters["text/html"]
    if html.type_printers.get(RunSnapshot) is run_summary and Run in html.type_printers:
        return  # registered for this shell by an earlier run (it is asked on every cell)
    html.for_type(RunSnapshot, run_summary)
    html.for_type(Run, lambda run: run_summary(run.snapshot()))
