"""A run's summary in both media (:mod:`nbdist.display.summary`), and how IPython is taught
to draw a snapshot and a run."""

from __future__ import annotations

from IPython.core.interactiveshell import InteractiveShell
from synthetic import T0, training_events

from nbdist.display.html import run_summary
from nbdist.display.summary import register_formatters, summary_bundle
from nbdist.display.text import format_summary
from nbdist.telemetry.recovery import Lost
from nbdist.telemetry.run import Run
from nbdist.telemetry.snapshot import RunSnapshot


def finished_run() -> Run:
    run = Run("cell", [0, 1], world_size=2)
    run.feed([{"rank": r, "seq": 1, "events": training_events(4)} for r in (0, 1)])
    run.note_recovery(Lost(T0, 1, "h", 7, "SIGKILL"))
    run.finish()
    return run


def test_the_bundle_is_the_text_table_and_the_static_html_with_or_without_the_notes():
    snap = finished_run().snapshot()
    full, quiet = summary_bundle(snap), summary_bundle(snap, notes=False)
    assert full == {"text/plain": format_summary(snap), "text/html": run_summary(snap)}
    note = snap.notes[0]  # "nbdist.elastic <time>: rank 1 on h (pid 7) died: SIGKILL"
    assert note in full["text/plain"] and note not in quiet["text/plain"]
    assert "died: SIGKILL" in quiet["text/plain"]  # the rank's row still says it
    assert quiet["text/html"] == full["text/html"]


def test_ipython_draws_a_snapshot_and_a_run_as_the_summary_once_registered():
    shell = InteractiveShell.instance()
    html = shell.display_formatter.formatters["text/html"]
    for cls in (RunSnapshot, Run):
        html.type_printers.pop(cls, None)  # as in a fresh kernel
    run = finished_run()
    snap = run.snapshot()
    register_formatters()
    register_formatters()  # asked again on every cell: harmless
    assert html.type_printers[RunSnapshot] is run_summary
    assert shell.display_formatter.format(run)[0]["text/html"] == run_summary(snap)
    assert shell.display_formatter.format(snap)[0]["text/plain"] == repr(snap)
