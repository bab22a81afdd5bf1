"""The one table model every view draws (:mod:`nbdist.table_layout`): text columns, HTML rows
with their colours, bars and widths, a cluster's status."""

from __future__ import annotations

import re

from nbdist import table_layout as L
from nbdist.table_layout import Row, Table, html_table, status_html, status_text, text_table

TABLE = Table(("rank", "progress", "state"),
              (Row(("0", "3/4", "running"), fraction=0.75, state="running", rank=0),
               Row(("12", "1/4", "failed: <x>"), broken=True, fraction=2.0, state="failed",
                   rank=12),
               Row(("max", "4/4", ""))))


def test_text_columns_are_as_wide_as_their_widest_cell_two_spaces_apart():
    assert text_table(TABLE) == ["rank  progress  state",
                                 "0     3/4       running",
                                 "12    1/4       failed: <x>",
                                 "max   4/4"]
    assert text_table(Table(("a", "bb"), ())) == ["a  bb"]


def test_html_rows_carry_their_rank_their_colour_and_escaped_cells():
    html = html_table(TABLE, bars=True)
    rows = re.findall(r"<tr class='([^']*)'", html)
    assert rows == ["nbdist-rank-row nbdist-rank-0", "nbdist-rank-row nbdist-rank-12 nbdist-broken",
                    "nbdist-aggregate-row"]
    assert f"style='color:{L.FAIL}'" in html and "failed: &lt;x&gt;" in html
    assert f"background:{L.rank_colour(12)}'></span>12" in html  # the rank's swatch
    # bars: the share filled, held to 0-100 %, in the state's colour (red when broken)
    assert f"width:75.0%;height:100%;background:{L.BAR['running']}" in html
    assert f"width:100.0%;height:100%;background:{L.FAIL}" in html
    assert "nbdist-bar" not in html_table(TABLE)  # no bars unless asked


def test_fixed_widths_bound_the_table_and_the_verdict_column_wraps():
    html = html_table(TABLE, widths=[40, None, 200], verdict="state", caption="a <caption>")
    assert "table-layout:fixed;width:100%;min-width:390px;max-width:540px" in html
    assert "<col style='width:40px'><col><col style='width:200px'>" in html
    heads = re.findall(r"<th style='([^']*)'", html)
    assert ["white-space:normal" in h for h in heads] == [False, False, True]  # the verdict
    assert "caption-side:top" in html and "a &lt;caption&gt;" in html


def test_a_clusters_status_is_a_line_then_a_row_per_worker():
    workers = Table(("worker", "host"), (Row(("0", "a")), Row(("1", "b"))))
    text = status_text("dask", 1, 2, workers, dist_backend="gloo", master="10.0.0.1")
    assert text.splitlines() == ["nbdist cluster: dask, 1/2 workers alive, backend gloo, "
                                 "MASTER_ADDR 10.0.0.1", "worker  host", "0       a", "1       b"]
    html = status_html("<engine>", 2, 2, workers)
    assert "&lt;engine&gt;: 2/2 workers alive" in html and "MASTER_ADDR" not in html
