"""Tables laid out as text or HTML, and nbdist's colours: a leaf that knows no record type.

A :class:`Table` is a header and rows of cells already written as strings; the records
(:mod:`nbdist.records`) and the views (:mod:`nbdist.display`) build tables, and this module
only lays them out: as text lines in aligned columns, or as an HTML table with inline styles,
so it looks the same in an output, inside a widget and in a saved notebook. The records draw
themselves through here (as dask's cluster repr fills a template with plain values), so they
never import the views. Remote text (host names, run names, error messages) is always escaped.
Imports nothing from nbdist.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import NamedTuple, Optional

#: step time split: compute, waiting for the last rank (idle grey), transfer (on the wire)
COMPUTE, WAITING, TRANSFER = "#4c78a8", "#a0a0a0", "#f58518"
#: bandwidth line; the axes
BANDWIDTH, AXIS = "#54a24b", "#888"
#: the rank everyone waits for: a colour no chart series uses
STRAGGLER = "#a4168f"
#: a failed rank, a dead worker, an action that did not work
FAIL = "#c00"
#: the hang doctor: a run that stopped making progress, the rank that held the others
HANG = "#b35900"
#: elastic training's recovery: a group re-formed, a replacement joined
RECOVERY = "#2e7d32"
#: text that says little (a clock, a quiet "no step for 3 s"), readable in light and dark
MUTED = "var(--jp-ui-font-color2, #666)"
#: progress bars by rank state
BAR = {"waiting": "#d0d0d0", "running": "#4a90d9", "done": "#59a14f", "failed": FAIL,
       "stopped": FAIL}
#: one colour per rank, the same in the tables (a mark by the rank's number) and the charts
RANK_COLOURS = ("#4c78a8", "#e45756", "#72b7b2", "#b8860b", "#9d755d", "#ff9da6", "#17becf",
                "#7f7f7f")


def rank_colour(rank: int) -> str:
    """Rank ``rank``'s colour, in every table and chart."""
    return RANK_COLOURS[rank % len(RANK_COLOURS)]

#: warnings from the ranks: amber on cream, apart from the failure red
WARNED, WARNED_BACKGROUND = "#8a5a00", "#fff8e6"


class Row(NamedTuple):
    cells: tuple[str, ...]
    #: a dead worker, or a rank that failed or stopped: views draw it in the failure colour
    broken: bool = False
    #: the rank the others wait for: views mark it in the straggler colour
    straggler: bool = False
    #: the progress bar's filled share (run tables; None: no bar with a total)
    fraction: Optional[float] = None
    #: the rank's state (run tables; "" for aggregate rows), for the bar's colour
    state: str = ""
    #: the rank this row shows (None: an aggregate over ranks)
    rank: Optional[int] = None
    #: the rank that held the others (it never reached the collective they waited in)
    held: bool = False
    #: a worker a replacement took the place of (not the rank's current row)
    former: bool = False


class Table(NamedTuple):
    """A header and its rows, every cell already formatted. Unpacks as ``header, rows``."""

    header: tuple[str, ...]
    rows: tuple[Row, ...]


# ----------------------------------------------------------------- text
def text_table(table: Table) -> list[str]:
    """The header and rows in left-aligned columns two spaces apart, one string per line."""
    header, rows = table
    cells = [row.cells for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
              for i, h in enumerate(header)]
    return ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip()
            for line in (header, *cells)]


# ----------------------------------------------------------------- HTML
_TABLE = ("border-collapse:collapse;font-size:12px;line-height:18px;"
          "font-variant-numeric:tabular-nums")
_CELL = "padding:1px 4px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis"
#: a column that says what happened: it wraps, it is never cut, and when a narrow output
#: scrolls the table it stays on screen at the right edge, over the numbers scrolled under it
_VERDICT = ("padding:1px 4px;white-space:normal;overflow-wrap:anywhere;position:sticky;right:0;"
            "background:var(--jp-layout-color0, #fff)")
_NUMERIC = {"count", "rate", "ETA", "compute", "waiting", "transfer", "bandwidth", "pid",
            "mem MiB"}
#: the bar's track, in the theme's colours where JupyterLab gives them
_TRACK = "var(--jp-layout-color3, #e8e8e8)"


def _bar(fraction: Optional[float], colour: str, label: str) -> str:
    fill = f"{100 * max(0.0, min(1.0, fraction or 0.0)):.1f}%"
    return (f"<div style='display:flex;align-items:center;gap:4px'>"
            f"<div class='nbdist-bar' style='width:48px;height:10px;background:{_TRACK};"
            f"border-radius:2px;overflow:hidden;flex:none'><div class='nbdist-bar-fill' "
            f"style='width:{fill};height:100%;background:{colour}'></div></div>"
            f"<span style='overflow:hidden;text-overflow:ellipsis'>{escape(label)}</span>"
            f"</div>")


def _row_html(header: Sequence[str], row: Row, bars: bool, verdict: str) -> str:
    if row.rank is None:
        classes = ["nbdist-aggregate-row"]
    elif row.former:
        classes = ["nbdist-rank-row", f"nbdist-rank-{row.rank}-former", "nbdist-former"]
    else:
        classes = ["nbdist-rank-row", f"nbdist-rank-{row.rank}"]
    style = ""
    if row.broken:
        classes.append("nbdist-broken")
        style = f" style='color:{FAIL}'"
    elif row.held:
        classes.append("nbdist-held")
        style = f" style='color:{HANG}'"
    if row.straggler:
        classes.append("nbdist-straggler")
    tds = []
    for name, cell in zip(header, row.cells):
        css = (_VERDICT if name == verdict else _CELL) + \
            (";text-align:right" if name in _NUMERIC else "")
        body = escape(cell)
        if name == "rank" and row.rank is not None:
            body = (f"<span class='nbdist-swatch' style='display:inline-block;width:8px;"
                    f"height:8px;margin-right:4px;background:{rank_colour(row.rank)}'></span>"
                    + body)
        if name == "rank" and row.straggler:
            css += f";color:{STRAGGLER};font-weight:bold;box-shadow:inset 3px 0 {STRAGGLER}"
        if bars and name == "progress" and row.fraction is not None:
            colour = FAIL if row.broken else STRAGGLER if row.straggler else \
                BAR.get(row.state, BAR["running"])
            body = _bar(row.fraction, colour, cell)
        # Whatever a narrow window cuts can be read on hover.
        title = f" title='{escape(cell)}'" if len(cell) > 3 and name != verdict else ""
        tds.append(f"<td style='{css}'{title}>{body}</td>")
    return f"<tr class='{' '.join(classes)}'{style}>{''.join(tds)}</tr>"


def html_table(table: Table, widths: Optional[Sequence[Optional[int]]] = None,
               bars: bool = False, verdict: str = "", caption: str = "") -> str:
    """A :class:`Table` as an HTML table; broken rows in red.

    With ``widths`` (px per column; None: the column takes what is left, 150 to 300 px) the
    layout is fixed, as wide as the output allows: a long value is cut with an ellipsis and
    shown whole on hover, except in the ``verdict`` column, which wraps, is never cut and
    stays on screen when a narrower output scrolls the table. ``bars`` draws the ``progress``
    column; ``caption`` is said above the table.
    """
    style = _TABLE
    cols = ""
    if widths:
        least, most = sum(w or 150 for w in widths), sum(w or 300 for w in widths)
        style += f";table-layout:fixed;width:100%;min-width:{least}px;max-width:{most}px"
        cols = "<colgroup>" + "".join(f"<col style='width:{w}px'>" if w else "<col>"
                                      for w in widths) + "</colgroup>"
    head = "".join(f"<th style='{_VERDICT if c == verdict else _CELL};"
                   f"text-align:{'right' if c in _NUMERIC else 'left'};"
                   f"border-bottom:1px solid {AXIS}' title='{escape(c)}'>{escape(c)}</th>"
                   for c in table.header)
    body = "".join(_row_html(table.header, row, bars, verdict) for row in table.rows)
    above = (f"<caption style='caption-side:top;text-align:left;font-size:12px;color:{MUTED}'>"
             f"{escape(caption)}</caption>" if caption else "")
    return (f"<table class='nbdist-table' style='{style}'>{above}{cols}<thead><tr>{head}</tr>"
            f"</thead><tbody>{body}</tbody></table>")


# ----------------------------------------------------------------- a cluster's status
def status_text(engine: str, alive: int, wanted: int, table: Table, *,
                dist_backend: Optional[str] = None, master: Optional[str] = None,
                held: Optional[str] = None) -> str:
    """A cluster's status as text: a line, one row per worker, then what the notebook holds."""
    head = (f"nbdist cluster: {engine}, {alive}/{wanted} workers alive"
            + (f", backend {dist_backend}" if dist_backend else "")
            + (f", MASTER_ADDR {master}" if master else ""))
    return "\n".join([head, *text_table(table), *([f"notebook holds: {held}"] if held else [])])


def status_html(engine: str, alive: int, wanted: int, table: Table, *,
                dist_backend: Optional[str] = None, master: Optional[str] = None,
                held: Optional[str] = None) -> str:
    """A cluster's status as HTML: a line, one row per worker, then what the notebook holds."""
    head = (f"<b>nbdist</b> {escape(engine)}: {alive}/{wanted} workers alive"
            + (f", backend <code>{escape(dist_backend)}</code>" if dist_backend else "")
            + (f", MASTER_ADDR <code>{escape(master)}</code>" if master else ""))
    foot = (f"<div style='margin-top:4px;font-size:12px;color:{MUTED}'>notebook holds: "
            f"{escape(held)}</div>" if held else "")
    return (f"<div class='nbdist-status'><div style='margin-bottom:4px'>{head}</div>"
            f"{html_table(table)}{foot}</div>")


# ----------------------------------------------------------------- runs side by side
#: ``(run name, value, the value as written)``: one bar of a comparison chart
BarItem = tuple[str, float, str]


def _bars_svg(title: str, items: Sequence[BarItem], colour: str, width: int = 420) -> str:
    """Horizontal bars, one per run, labelled with the run's name and its value."""
    if not items or max(v for _, v, _ in items) <= 0:
        return ""
    top = max(v for _, v, _ in items)
    pad_l, bar_h = 110, 16
    height = 18 + bar_h * len(items)
    w = width - pad_l - 70
    rows = []
    for i, (name, v, label) in enumerate(items):
        y = 16 + i * bar_h
        rows.append(f"<text x='{pad_l - 4}' y='{y + 11}' text-anchor='end'>{escape(name)}</text>"
                    f"<rect x='{pad_l}' y='{y + 2}' width='{w * v / top:.1f}' height='{bar_h - 4}'"
                    f" fill='{colour}'/><text x='{pad_l + w * v / top + 4:.1f}' y='{y + 11}'>"
                    f"{escape(label)}</text>")
    return (f"<svg class='nbdist-compare-chart' xmlns='http://www.w3.org/2000/svg' "
            f"width='{width}' height='{height}' viewBox='0 0 {width} {height}' "
            f"font-family='sans-serif' font-size='10'><text x='{pad_l}' y='10'>{escape(title)}"
            f"</text>{''.join(rows)}</svg>")


def comparison_html(table: Table, throughput: Sequence[BarItem], held: Sequence[BarItem],
                    notes: Sequence[str] = ()) -> str:
    """Named runs side by side: the table, the ``notes`` (each run's verdicts in full), then
    bars of each run's throughput (samples/s over all ranks) and of what one rank holds
    (params + grads + optimizer state)."""
    chart = (_bars_svg("samples/s (all ranks)", throughput, COMPUTE)
             + _bars_svg("params + grads + optimizer state per rank", held, TRANSFER))
    said = ("<ul class='nbdist-verdicts' style='font-size:12px;margin:4px 0;padding-left:18px'>"
            + "".join(f"<li>{escape(n)}</li>" for n in notes) + "</ul>") if notes else ""
    return f"<div class='nbdist-compare'>{html_table(table)}{said}<div>{chart}</div></div>"
