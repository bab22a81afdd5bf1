"""What users hold: a cluster's status renders as text and as escaped HTML."""

from __future__ import annotations

from nbdist.records import ClusterStatus, WorkerRow


def test_status_renders_text_and_escaped_html():
    st = ClusterStatus("ipyparallel", 2, (
        WorkerRow(0, "0", "h<1>", 10, "cpu", True, 300.0),
        WorkerRow(1, "1", "h2", None, None, False, None, "gone")))
    text = repr(st)
    assert "1/2 workers alive" in text and "NO" in text
    html = st._repr_html_()
    assert "h&lt;1&gt;" in html and "<table " in html
