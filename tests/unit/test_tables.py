"""The one table model: text and HTML lay out the same headers and rows (pure, no cluster)."""

from __future__ import annotations

from html.parser import HTMLParser

from synthetic import T0, training_events

from nbdist.display.html import run_summary, status_table
from nbdist.display.tables import RUN_HEADER, STATUS_HEADER, run_table, status_rows
from nbdist.display.text import format_status, format_summary
from nbdist.records import ClusterStatus, WorkerRow
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
    """Every <tr> of an HTML table as the text of its cells, and its style attribute."""

    def __init__(self, markup: str):
        super().__init__()
        self.rows: list[list[str]] = []
        self.styles: list[str] = []
        self._cell = None
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
            self.styles.append(dict(attrs).get("style") or "")
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
    by_rank = {row.cells[0]: row for row in rows}
    assert by_rank["0"].cells[1] == "done" and not by_rank["0"].broken
    # one line, unescaped: the model holds plain text, the views escape it
    assert by_rank["1"].cells[1] == "failed: ValueError: <bad> &co" and by_rank["1"].broken
    assert by_rank["2"].cells[1].startswith("stopped: ") and by_rank["2"].broken
    assert by_rank["0"].cells[2] == "8" and by_rank["0"].cells[5].endswith("ms")
    assert by_rank["0"].cells[6].endswith("%") and by_rank["0"].cells[7].endswith("B/s")


def test_html_escapes_remote_strings_and_colours_broken_rows():
    snap = failed_run()
    markup = run_summary(snap)
    assert "ValueError: &lt;bad&gt; &amp;co" in markup and "<bad>" not in markup
    parsed = _Cells(markup)
    broken = [row.broken for row in run_table(snap).rows]
    assert [bool(s) for s in parsed.styles[1:]] == broken  # row 0 is the header
    assert "straggler: rank 2" in markup and "straggler: rank 2" in format_summary(snap)


def test_status_text_and_html_show_the_same_table():
    st = status()
    header, rows = status_rows(st)
    assert header == STATUS_HEADER
    expected = [list(header), *(list(row.cells) for row in rows)]
    assert text_cells(format_status(st), header) == expected
    parsed = _Cells(status_table(st))
    assert parsed.rows == expected
    assert [bool(s) for s in parsed.styles[1:]] == [False, True, False]  # the dead worker
    assert expected[1] == ["0", "h<1>", "10", "cpu", "yes", "300", "idle"]
    assert expected[2] == ["1", "h2", "-", "-", "NO", "-", "gone"]
    assert expected[3] == ["-", "h3", "12", "cuda:0", "yes", "1235", "busy"]
    assert "h&lt;1&gt;" in status_table(st) and "h<1>" not in status_table(st)


def test_empty_tables_still_have_their_headers():
    empty = ClusterStatus("none", 0)
    assert format_status(empty).splitlines()[1].split() == " ".join(STATUS_HEADER).split()
    assert _Cells(status_table(empty)).rows == [list(STATUS_HEADER)]


def test_rank_states_come_from_the_enum():
    snap = failed_run()
    assert {r.state for r in snap.ranks} == {RankState.DONE, RankState.FAILED, RankState.STOPPED}
    assert all(isinstance(r.state, RankState) for r in snap.ranks)
