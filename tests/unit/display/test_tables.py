"""The one table model: text and HTML lay out the same headers and rows (pure, no cluster)."""

from __future__ import annotations

import re
from html.parser import HTMLParser

from synthetic import T0, aggregate_job, training_events

from nbdist import table_layout as L
from nbdist.display import html as H
from nbdist.display.html import run_summary
from nbdist.display.tables import AGGREGATE_ABOVE, RUN_HEADER, diagnosis_phrases, run_table
from nbdist.display.text import format_line, format_summary
from nbdist.records import STATUS_HEADER, ClusterStatus, WorkerRow
from nbdist.telemetry import events as ev
from nbdist.telemetry.aggregate import RunState
from nbdist.telemetry.states import RankState


def training(ranks=(0, 1, 2), steps=8, slow_rank=2):
    state = RunState(ranks)
    for r in ranks:
        state.feed([{"rank": r, "seq": 1, "events": training_events(steps, r == slow_rank)}])
    return state


def failed_run():
    """Rank 0 done, rank 1 failed with a two-line remote reason, rank 2 a straggler, stopped."""
    state = training()
    state.feed([{"rank": 0, "seq": 2, "events": [ev.end(True, T0 + 2)]},
                {"rank": 1, "seq": 2, "events": [ev.end(False, T0 + 2, "ValueError: <bad>\n&co")]}])
    state.finish()
    return state.snapshot()


def status():
    return ClusterStatus("ipyparallel", 3, (
        WorkerRow(0, "0", "h<1>", 10, "cpu", True, 300.0),
        WorkerRow(1, "1", "h2", None, None, False, None, "gone"),
        WorkerRow(None, "2", "h3", 12, "cuda:0", True, 1234.6, "busy")))


class _Cells(HTMLParser):
    """Every <tr> of an HTML table as the text of its cells, its style and class attributes."""

    def __init__(self, markup: str):
        super().__init__()
        self.rows: list[list[str]] = []
        self.styles: list[str] = []
        self.classes: list[str] = []
        self._cell = None
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
            self.styles.append(dict(attrs).get("style") or "")
            self.classes.append(dict(attrs).get("class") or "")
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.rows[-1].append(self._cell)
            self._cell = None


def text_cells(text: str, header) -> list[list[str]]:
    """Cut a laid-out text table at its header's column starts (the first line is a title)."""
    lines = text.splitlines()[1:]
    starts, at = [], 0
    for label in header:
        at = lines[0].index(label, at)
        starts.append(at)
        at += len(label)
    cuts = list(zip(starts, [*starts[1:], None]))
    return [[line[a:b].strip() for a, b in cuts] for line in lines]


def test_run_summary_text_and_html_show_the_same_table():
    snap = failed_run()
    header, rows = run_table(snap)
    assert header == RUN_HEADER
    expected = [list(header), *(list(row.cells) for row in rows)]
    assert text_cells(format_summary(snap), header) == expected
    assert _Cells(run_summary(snap)).rows == expected


def test_run_table_rows_carry_state_reason_and_broken_flag():
    snap = failed_run()
    assert snap.stragglers == (2,)
    (_, rows) = run_table(snap)
    cells = {row.cells[0]: dict(zip(RUN_HEADER, row.cells)) for row in rows}
    by_rank = {row.cells[0]: row for row in rows}
    assert cells["0"]["state"] == "done" and not by_rank["0"].broken
    # one line, unescaped: the model holds plain text, the views escape it
    assert cells["1"]["state"] == "failed: ValueError: <bad> &co" and by_rank["1"].broken
    assert cells["2"]["state"].startswith("stopped, straggler: ") and by_rank["2"].broken
    assert by_rank["2"].straggler and not by_rank["0"].straggler
    # one counter and one rate, units beside every number
    assert cells["0"]["count"] == "8 steps" and cells["0"]["rate"] == "10 steps/s"
    for name in ("compute", "waiting", "transfer"):
        assert cells["0"][name].endswith("ms"), name
    assert cells["0"]["compute"] == "50 ms" and cells["2"]["compute"] == "90 ms"
    assert cells["0"]["waiting"] == "40 ms" and cells["0"]["transfer"] == "10 ms"
    assert cells["0"]["bandwidth"].endswith("B/s")


def test_html_escapes_remote_strings_and_colours_broken_rows():
    snap = failed_run()
    markup = run_summary(snap)
    assert "ValueError: &lt;bad&gt; &amp;co" in markup and "<bad>" not in markup
    parsed = _Cells(markup)
    broken = [row.broken for row in run_table(snap).rows]
    assert [L.FAIL in s for s in parsed.styles[1:]] == broken  # row 0 is the header
    assert ["nbdist-straggler" in c for c in parsed.classes[1:]] == [False, False, True]
    # the header names the rank everyone waits for, in the straggler colour
    assert f"color:{L.STRAGGLER}'>rank 2 is 40 ms/step slower" in markup
    assert "rank 2 is 40 ms/step slower" in format_summary(snap)


def test_one_bandwidth_everywhere():
    """Header, rows, text line and chart all show the same figure, bytes over transfer time."""
    snap = aggregate_job({0: 0.010, 1: 0.015})
    bw = "500 kB/s"  # 2000 bytes per step over the 4 ms rank 1 spent in the two all-reduces
    assert [r.cells[RUN_HEADER.index("bandwidth")] for r in run_table(snap).rows] == [bw, bw]
    assert f"bandwidth {bw} per rank" in diagnosis_phrases(snap)
    assert f"bandwidth {bw}" in format_line(snap)
    chart = H.bandwidth_chart_svg(snap.series)
    assert f">{bw}<" in chart and "bytes ÷ transfer time" in chart
    assert ">0<" in chart  # the axis starts at zero
    line = format_line(snap)
    assert "rank 1 is 5 ms/step slower (compute 15 ms)" in line
    assert "others wait 29% of their step" in line and "transfer 12%" in line


def test_many_ranks_become_min_median_max_rows_and_named_outliers():
    compute = {r: 0.010 for r in range(40)}
    compute[17] = 0.016
    snap = aggregate_job(compute)
    header, rows = run_table(snap)
    assert len(snap.ranks) > AGGREGATE_ABOVE
    labels = [row.cells[0] for row in rows]
    assert labels == ["min", "median", "max", "17"]
    col = {name: [row.cells[i] for row in rows] for i, name in enumerate(header)}
    assert col["compute"][:3] == ["10 ms", "10 ms", "16 ms"]
    assert col["waiting"][:3] == ["0 ms", "6 ms", "6 ms"]
    assert rows[3].straggler and "straggler" in col["state"][3]
    assert col["state"][1] == "40 running"
    # the text table lays out the same rows
    text = format_summary(snap).splitlines()
    assert [line.split()[0] for line in text[2:]] == labels
    small = run_table(aggregate_job({r: 0.01 for r in range(AGGREGATE_ABOVE)}))
    assert [row.cells[0] for row in small.rows] == [str(r) for r in range(AGGREGATE_ABOVE)]


def test_run_table_columns_have_fixed_widths_and_only_the_state_wraps():
    markup = H.run_table_html(failed_run())
    # as wide as the output allows: the state takes what the fixed columns leave, 150 px or more
    least = sum(w or 150 for w in H.RUN_WIDTHS)
    assert f"table-layout:fixed;width:100%;min-width:{least}px;max-width:" in markup
    assert len(re.findall("<col[ >]", markup)) == len(RUN_HEADER) == len(H.RUN_WIDTHS)
    assert H.RUN_WIDTHS[RUN_HEADER.index("state")] is None
    rows = re.findall(r"<tr class='nbdist-rank-row[^>]*>(.*?)</tr>", markup)
    for row in rows:
        cells = re.findall(r"<td style='([^']*)'", row)
        assert all("white-space:nowrap" in c for c in cells[:-1])
        # the verdict wraps, is never cut, and stays on screen when the table scrolls
        assert "white-space:normal" in cells[-1] and "position:sticky;right:0" in cells[-1]
    # a value elsewhere that a narrow window may cut is shown whole on hover
    assert "title='10 steps/s'" in markup and "title='100 kB/s'" in markup
    assert ">failed: ValueError: &lt;bad&gt; &amp;co<" in markup


def test_straggler_and_exposed_communication_colours_differ():
    colours = {L.COMPUTE, L.WAITING, L.TRANSFER, L.STRAGGLER, L.FAIL, L.BANDWIDTH}
    assert len(colours) == 6
    # the straggler keeps its colour when the run is over (its bar, its rank cell)
    snap = aggregate_job({0: 0.010, 1: 0.015})
    done = _finish(snap)
    markup = H.run_table_html(done)
    row = markup[markup.index("nbdist-rank-1"):]
    row = row[:row.index("</tr>")]
    assert f"background:{L.STRAGGLER}" in row and f"color:{L.STRAGGLER}" in row
    assert "finished in" in H.run_header(done, final=True)


def _finish(snap):
    from dataclasses import replace

    from nbdist.telemetry.states import RankState

    return replace(snap, ranks=tuple(replace(r, state=RankState.DONE) for r in snap.ranks),
                   wall_s=12.5)


def test_scalar_charts_say_whose_values_they_show():
    same = {0: ((0.0, 1.0), (1.0, 0.5)), 1: ((0.0, 1.0), (1.0, 0.5))}
    assert "loss · ranks 0-1 (equal)" in H.scalar_chart_svg("loss", same)
    differ = {0: ((0.0, 1.0), (1.0, 0.5)), 1: ((0.0, 2.0), (1.0, 0.7))}
    svg = H.scalar_chart_svg("loss", differ)
    assert svg.count("<polyline") == 2 and ">rank 0<" in svg and ">rank 1<" in svg
    many = {r: ((0.0, float(r)), (1.0, r / 2)) for r in range(12)}
    svg = H.scalar_chart_svg("acc", many)
    assert "median of ranks 0-11" in svg and svg.count("<polyline") == 3


def test_status_text_and_html_show_the_same_table():
    st = status()
    header, rows = st.table()
    assert header == STATUS_HEADER
    expected = [list(header), *(list(row.cells) for row in rows)]
    assert text_cells(repr(st), header) == expected
    parsed = _Cells(st._repr_html_())
    assert parsed.rows == expected
    assert [bool(s) for s in parsed.styles[1:]] == [False, True, False]  # the dead worker
    assert expected[1] == ["0", "h<1>", "10", "cpu", "yes", "300", "idle"]
    assert expected[2] == ["1", "h2", "-", "-", "NO", "-", "gone"]
    assert expected[3] == ["-", "h3", "12", "cuda:0", "yes", "1235", "busy"]
    assert "h&lt;1&gt;" in st._repr_html_() and "h<1>" not in st._repr_html_()


def test_empty_tables_still_have_their_headers():
    empty = ClusterStatus("none", 0)
    assert repr(empty).splitlines()[1].split() == " ".join(STATUS_HEADER).split()
    assert _Cells(empty._repr_html_()).rows == [list(STATUS_HEADER)]


def test_rank_states_come_from_the_enum():
    snap = failed_run()
    assert {r.state for r in snap.ranks} == {RankState.DONE, RankState.FAILED, RankState.STOPPED}
    assert all(isinstance(r.state, RankState) for r in snap.ranks)


def test_the_count_column_says_one_step_and_one_call_in_the_singular():
    def calls(n):
        return [ev.comm("all_reduce", T0 + k, T0 + k + 0.01, 64) for k in range(n)]

    counts = []
    for events in (training_events(1), calls(1), calls(2)):
        state = RunState((0, 1))
        state.feed([{"rank": r, "seq": 1, "events": events} for r in (0, 1)])
        (_, rows) = run_table(state.snapshot())
        counts.append(dict(zip(RUN_HEADER, rows[0].cells))["count"])
    assert counts == ["1 step", "1 call", "2 calls"]
