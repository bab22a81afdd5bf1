"""Static HTML: what stays readable in a saved notebook (GitHub, nbviewer), and what the
widgets show.

The views' markup lives here (tables are laid out, and the colours defined, in the leaf
:mod:`nbdist.table_layout`, which the records draw through too); the widgets set their values from
these functions. Remote text (host names, error messages, progress labels) is always escaped.
Styles are inline, so a view looks the same in an output, inside a widget and in a saved
notebook.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from html import escape
from typing import TYPE_CHECKING, Optional

from ..table_layout import (
    AXIS,
    BANDWIDTH,
    COMPUTE,
    FAIL,
    HANG,
    MUTED,
    RANK_COLOURS,
    RECOVERY,
    STRAGGLER,
    TRANSFER,
    WAITING,
    html_table,
    rank_colour,
)
from ..telemetry.units import fmt_bytes_rate, fmt_ranks, fmt_seconds
from .static_charts import static_chart
from .tables import (
    DEFINITIONS,
    MEMORY_CAPTION,
    diagnosis_phrases,
    dims_table,
    failure_lines,
    memory_table,
    pipeline_table,
    progress_phrases,
    quiet_phrase,
    run_table,
    stall_lines,
    verdict_lines,
)

if TYPE_CHECKING:
    from ..telemetry.recovery import Mark
    from ..telemetry.snapshot import RunSnapshot, StepPoint

#: ranks drawn one line each in a scalar chart; above, median with a min-max band
MAX_LINES = 8
#: a step longer than this many times the 90th percentile is cut at the step chart's top
CUT_ABOVE = 4.0

#: the run table's column widths (px): numbers whole, the bar named; the state takes what is
#: left (150 px at least) and wraps: the table fits JupyterLab's cell at 1400 px with the file
#: browser open, and in a narrower output it scrolls with the state column kept in view. The
#: three time columns hold "<0.01 ms" in the straggler's bold (71.5 px in JupyterLab's font,
#: padding included; 62 cut it), the rate "999 steps/s" (85.5); the bar's name and the last
#: values give the width back (cut, they are read whole on hover)
RUN_WIDTHS = (44, 140, 80, 86, 54, 72, 72, 72, 80, 90, None)


def bold(text: str) -> str:
    """``text``, escaped, in bold."""
    return f"<b>{escape(text)}</b>"


def message(text: str) -> str:
    """``text`` escaped, with ```code``` spans (as nbdist's messages write them) as code."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", escape(text, quote=False))


def error_text(text: str) -> str:
    """``text`` (a message) in the failure colour."""
    return f"<span style='color:{FAIL}'>{message(text)}</span>"


def warning_text(text: str, colour: str = STRAGGLER) -> str:
    """``text``, escaped, in bold in the straggler colour (or ``colour``)."""
    return f"<b style='color:{colour}'>{escape(text)}</b>"


def muted(text: str) -> str:
    """``text``, escaped, in the quiet colour of clocks and asides."""
    return f"<span style='color:{MUTED}'>{escape(text)}</span>"


def _phrases(parts: Sequence[str]) -> str:
    """Phrases joined by `` · ``, each kept on one line (a wrap never splits a number)."""
    return " · ".join(f"<span style='white-space:nowrap'>{p}</span>" for p in parts)


# ----------------------------------------------------------------- cluster
def cluster_stopped(reason: str) -> str:
    """What the cluster panel shows once no cluster is running."""
    return (f"<div class='nbdist-status nbdist-stopped'><b>nbdist</b> "
            f"<b style='color:{FAIL}'>stopped</b>: {message(reason)}</div>")


def refreshed_note(interval: Optional[float], clock: str, error: str = "") -> str:
    """Under the cluster panel: how fresh it is, and why the last refresh failed."""
    every = f"refreshes every {interval:g} s while shown · " if interval else ""
    note = f"<small style='color:{AXIS}'>{every}updated {escape(clock)}</small>"
    return note + (f"<br>{error_text('refresh failed: ' + error)}" if error else "")


#: shown under the cluster panel's Scale control
SCALE_NOTE = ("<small>Scaling re-forms the process group at the new size before the next "
              "<code>%%distributed</code> cell. Rebuild what depends on the world size: "
              "DistributedDataParallel models, optimizers, samplers and data loaders. Workers "
              "that stay keep their namespace; new workers start empty (re-run set-up cells "
              "or <code>%nbdist push</code>).</small>")


# ----------------------------------------------------------------- run telemetry
def run_header(snap: RunSnapshot, final: bool = False) -> str:
    """The run's state, elapsed time and pace (and, when nothing moved for a while, for how
    long); where its step time goes; then the last thing that happened to the job, in its
    meaning's colour, with the earlier ones a click away."""
    first = [escape(p) for p in progress_phrases(snap, final)]
    quiet = quiet_phrase(snap, final)
    if quiet:
        first.append(f"<span class='nbdist-quiet'>{muted(quiet)}</span>")
    diag = diagnosis_phrases(snap)
    if snap.stragglers and diag:
        diag_html = [warning_text(diag[0])] + [escape(p) for p in diag[1:]]
    else:
        diag_html = [escape(p) for p in diag]
    second = f"<div>{_phrases(diag_html)}</div>" if diag_html else ""
    return (f"<div class='nbdist-header' style='font-size:13px;line-height:20px'>"
            f"<div><b>nbdist</b> {_phrases(first)}</div>{second}{events(snap.marks)}</div>")


def _mark_colour(mark: Mark) -> str:
    return FAIL if mark.failure else RECOVERY


def events(marks: Sequence[Mark]) -> str:
    """The last thing that happened to the job, in one line; the earlier ones, oldest first,
    folded under it ("" when nothing happened)."""
    if not marks:
        return ""
    last = marks[-1]
    said = _event_text(last)
    line = (f"<div class='nbdist-last-event' title='{escape(said)}' style='white-space:nowrap;"
            f"overflow:hidden;text-overflow:ellipsis'>"
            f"{warning_text(said, _mark_colour(last))}</div>")
    if len(marks) == 1:
        return line
    earlier = "".join(f"<li style='color:{_mark_colour(m)}'>{escape(_event_text(m))}</li>"
                      for m in marks[:-1])
    return (line + f"<details class='nbdist-events' style='font-size:12px'><summary "
            f"style='cursor:pointer;color:{MUTED}'>{len(marks) - 1} earlier event"
            f"{'s' if len(marks) > 2 else ''}</summary><ul style='margin:2px 0'>{earlier}"
            f"</ul></details>")


def _event_text(mark: Mark) -> str:
    """A mark's line without the ``nbdist.elastic`` prefix (the dashboard is nbdist's), and
    the step of a death or a join."""
    text = mark.text.removeprefix("nbdist.elastic ")
    at = mark.step is not None and mark.kind in ("died", "joined")
    return text + (f" (at step {mark.step})" if at else "")


def run_table_html(snap: RunSnapshot) -> str:
    """The run's table with progress bars, in fixed columns: numbers are never cut, other
    cells cut can be read on hover, and the state column wraps."""
    # contain: the table's least width must not widen the output around it (the box scrolls)
    return (f"<div style='overflow-x:auto;contain:inline-size'>"
            f"{html_table(run_table(snap), RUN_WIDTHS, bars=True, verdict='state')}</div>")


def _swatch(colour: str, label: str, hover: str) -> str:
    return (f"<span title='{escape(hover)}' style='white-space:nowrap'>"
            f"<span style='display:inline-block;width:10px;height:10px;background:{colour};"
            f"margin:0 3px 0 8px'></span>{escape(label)}</span>")


def legend() -> str:
    """Colour keys (hover one for its definition) and how every column is measured."""
    defs = dict(DEFINITIONS)
    keys = (_swatch(COMPUTE, "compute", defs["compute"])
            + _swatch(WAITING, "waiting", defs["waiting"])
            + _swatch(TRANSFER, "transfer", defs["transfer"])
            + _swatch(STRAGGLER, "straggler: the rank the others wait for",
                      "flagged when the others spend at least 5% of their step (and 1 ms) "
                      "waiting for it, over the last 20 steps")
            + _swatch(HANG, "hang", "no progress past the stall threshold; the rank that "
                      "held the others, when a timeout or an interrupt stopped the run")
            + _swatch(FAIL, "failure", "a rank failed, stopped or died; the reason is in its "
                      "row")
            + _swatch(RECOVERY, "recovery", "elastic training re-formed the group, or a "
                      "replacement joined"))
    items = "".join(f"<li><b>{escape(k)}</b>: {escape(v)}</li>" for k, v in DEFINITIONS)
    return (f"<div class='nbdist-legend' style='font-size:11px;color:{MUTED}'>{keys}"
            f"<details style='display:inline;margin-left:8px'><summary style='display:inline;"
            f"cursor:pointer'>how these are measured</summary>"
            f"<ul style='margin:2px 0'>{items}</ul></details></div>")


def failures(snap: RunSnapshot) -> str:
    """Each failed or dead rank's reason in full, in red ("" when none)."""
    lines = failure_lines(snap)
    if not lines:
        return ""
    return ("<div class='nbdist-failures' style='font-size:12px'>"
            + "<br>".join(error_text(line) for line in lines) + "</div>")


def verdicts(snap: RunSnapshot) -> str:
    """What the numbers mean, one sentence per line ("" when they call for none)."""
    said = verdict_lines(snap)
    if not said:
        return ""
    items = "".join(f"<li>{message(line)}</li>" for line in said)
    return (f"<div class='nbdist-verdicts' style='font-size:12px;margin:4px 0'><b>verdicts</b>"
            f"<ul style='margin:2px 0;padding-left:18px'>{items}</ul></div>")


def stall(snap: RunSnapshot) -> str:
    """The hang doctor's verdict: its headline in bold, then where each rank is ("" when the
    run is not stalled)."""
    lines = stall_lines(snap)
    if not lines:
        return ""
    ranks = escape("\n".join(lines[1:]))
    return (f"<div class='nbdist-stall' style='font-size:12px;margin:4px 0'>"
            f"{warning_text(lines[0], HANG)}"
            f"<pre style='margin:2px 0;white-space:pre-wrap'>{ranks}</pre></div>")


def _svg(cls: str, width: int, height: int, title: str, hover: str, body: str) -> str:
    # Text takes the output's colour: readable in JupyterLab's light and dark themes alike.
    return (f"<svg class='{cls}' xmlns='http://www.w3.org/2000/svg' width='{width}' "
            f"height='{height}' viewBox='0 0 {width} {height}' font-family='sans-serif' "
            f"font-size='10' fill='currentColor'><title>{escape(hover)}</title>"
            f"<text x='4' y='10'>{title}</text>{body}</svg>")


_PAD_L, _PAD_T, _PAD_B = 56, 16, 14


def _axes(width: int, height: int, top: str, bottom: str, lo: str, hi: str) -> str:
    """A y-axis labelled at its top and bottom (``bottom`` is 0 for times and bandwidth)."""
    y0 = height - _PAD_B
    return (f"<text x='{_PAD_L - 4}' y='{_PAD_T + 8}' text-anchor='end'>{escape(top)}</text>"
            f"<text x='{_PAD_L - 4}' y='{y0}' text-anchor='end'>{escape(bottom)}</text>"
            f"<line x1='{_PAD_L}' y1='{_PAD_T}' x2='{_PAD_L}' y2='{y0}' stroke='{AXIS}'/>"
            f"<line x1='{_PAD_L}' y1='{y0}' x2='{width - 4}' y2='{y0}' stroke='{AXIS}'/>"
            f"<text x='{_PAD_L}' y='{height - 2}'>{escape(lo)}</text>"
            f"<text x='{width - 4}' y='{height - 2}' text-anchor='end'>{escape(hi)}</text>")


def step_chart_svg(series: Sequence[StepPoint], width: int = 420, height: int = 120,
                   marks: Sequence[Mark] = ()) -> str:
    """Stacked bars per step, mean over the ranks that ran it: compute, then transfer, then
    waiting; a vertical rule where a rank died or a replacement joined."""
    pts = list(series)[-120:]
    top = _chart_top([p.step_s for p in pts])
    if not pts or top <= 0:
        return ""
    w, h = width - _PAD_L - 4, height - _PAD_T - _PAD_B
    bw = w / len(pts)
    bars = []
    for i, p in enumerate(pts):
        x, y = _PAD_L + 1 + i * bw, float(height - _PAD_B)
        # a step far longer than the others (a wait for a replacement) is drawn to the top,
        # cut, with a mark: one step must not flatten all the others
        scale = min(1.0, top / p.step_s) if p.step_s > 0 else 1.0
        rects = ""
        for value, colour in ((p.compute_s, COMPUTE), (p.transfer_s, TRANSFER),
                              (p.waiting_s, WAITING)):
            hh = h * max(0.0, value) * scale / top
            y -= hh
            rects += (f"<rect x='{x:.1f}' y='{y:.1f}' width='{max(bw - 1, 0.5):.1f}' "
                      f"height='{hh:.1f}' fill='{colour}'/>")
        if scale < 1.0:
            mid = x + max(bw - 1, 0.5) / 2
            rects += (f"<path class='nbdist-cut-bar' d='M{mid - 3:.1f},{_PAD_T - 1} "
                      f"L{mid + 3:.1f},{_PAD_T - 1} L{mid:.1f},{_PAD_T - 5} Z' "
                      f"fill='currentColor'/>")
        tip = (f"step {p.step}: {fmt_seconds(p.step_s)} = compute {fmt_seconds(p.compute_s)}"
               f" + transfer {fmt_seconds(p.transfer_s)} + waiting {fmt_seconds(p.waiting_s)}"
               + (f" (for rank {p.waited_for})" if p.waited_for is not None else "")
               + f", mean of the {p.ranks} rank{'s' if p.ranks > 1 else ''} that ran it")
        bars.append(f"<g><title>{escape(tip)}</title>{rects}</g>")
    sizes = sorted({p.ranks for p in pts})
    ranks = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    title = (f"time per step, mean of {ranks} rank{'s' if sizes[-1] > 1 else ''}: "
             f"<tspan fill='{COMPUTE}'>compute</tspan> + <tspan fill='{TRANSFER}'>transfer"
             f"</tspan> + <tspan fill='{WAITING}'>waiting</tspan>")
    return _svg("nbdist-step-chart", width, height, title,
                "compute: step time less exposed communication; transfer and waiting: the "
                "exposed communication, split at the last rank to arrive",
                _axes(width, height, fmt_seconds(top), "0", f"step {pts[0].step}",
                      f"step {pts[-1].step}") + "".join(bars)
                + _rules(marks, [p.step for p in pts], bw, height))


def _chart_top(lengths: Sequence[float]) -> float:
    """The step chart's top: the longest step, unless it is over :data:`CUT_ABOVE` times the
    step most steps stay under (the 90th percentile); then that much, and longer steps cut."""
    if not lengths:
        return 0.0
    ordered = sorted(lengths)
    typical = ordered[(len(ordered) - 1) * 9 // 10]
    return min(ordered[-1], CUT_ABOVE * typical) if typical > 0 else ordered[-1]


def _rules(marks: Sequence[Mark], steps: Sequence[int], bw: float, height: int) -> str:
    """A vertical rule before the first bar at or after each mark's step, labelled; marks
    before the first bar drawn are left out (the table and header still say them)."""
    out = []
    for m in marks:
        if m.kind not in ("died", "joined") or m.step is None or m.step < steps[0]:
            continue
        i = next((i for i, s in enumerate(steps) if s >= m.step), len(steps))
        x = _PAD_L + 0.5 + i * bw
        colour = FAIL if m.failure else RECOVERY
        # the label on the side with room: right of the rule, or left of it near the end
        right = x < _PAD_L + 0.6 * bw * len(steps)
        at = f"x='{x + 2 if right else x - 2:.1f}' text-anchor='{'start' if right else 'end'}'"
        out.append(f"<g class='nbdist-mark'><title>{escape(_event_text(m))}</title>"
                   f"<line x1='{x:.1f}' y1='{_PAD_T}' x2='{x:.1f}' y2='{height - _PAD_B}' "
                   f"stroke='{colour}' stroke-width='1.5' stroke-dasharray='3 2'/>"
                   f"<text {at} y='{_PAD_T + 9 + 11 * len(out)}' fill='{colour}'>"
                   f"{escape(m.label)}</text></g>")
    return "".join(out)


def bandwidth_chart_svg(series: Sequence[StepPoint], width: int = 420, height: int = 90) -> str:
    """Bandwidth per step (bytes over transfer time, median of ranks), from zero."""
    pts = [p for p in list(series)[-120:] if p.bandwidth]
    if not pts:
        return ""
    top = max(p.bandwidth or 0.0 for p in pts)
    lo, hi = pts[0].step, max(pts[-1].step, pts[0].step + 1)
    w, h = width - _PAD_L - 4, height - _PAD_T - _PAD_B
    xy = " ".join(f"{_PAD_L + w * (p.step - lo) / (hi - lo):.1f},"
                  f"{_PAD_T + h - h * (p.bandwidth or 0.0) / top:.1f}" for p in pts)
    return _svg("nbdist-bandwidth-chart", width, height,
                f"<tspan fill='{BANDWIDTH}'>bandwidth</tspan> per step = bytes ÷ transfer time",
                dict(DEFINITIONS)["bandwidth"],
                _axes(width, height, fmt_bytes_rate(top), "0", f"step {lo}",
                      f"step {pts[-1].step}")
                + f"<polyline fill='none' stroke='{BANDWIDTH}' stroke-width='1.5' "
                  f"points='{xy}'/>")


def _line(points: Sequence[tuple[float, float]], box: tuple[float, float, float, float],
          colour: str, width: int, height: int) -> str:
    x0, x1, y0, y1 = box
    w, h = width - _PAD_L - 4, height - _PAD_T - _PAD_B
    xy = " ".join(f"{_PAD_L + w * (x - x0) / ((x1 - x0) or 1):.1f},"
                  f"{_PAD_T + h - h * (y - y0) / ((y1 - y0) or 1):.1f}" for x, y in points)
    return f"<polyline fill='none' stroke='{colour}' stroke-width='1.3' points='{xy}'/>"


def scalar_chart_svg(name: str, by_rank: dict[int, tuple[tuple[float, float], ...]],
                     width: int = 280, height: int = 100,
                     spread: Optional[Sequence[tuple[float, float, float, float]]] = None
                     ) -> str:
    """One logged value over steps: a line per rank where ranks differ, one line labelled
    with every rank where they agree, median and min-max band above :data:`MAX_LINES` ranks
    (from ``spread``, ``(step, min, median, max)`` per step, when the fold gave it: drawing
    it from a thousand ranks' curves at every redraw would cost more than the run)."""
    series = {r: pts for r, pts in by_rank.items() if pts}
    if not series:
        return ""
    ranks = sorted(series)
    if spread and len(ranks) > MAX_LINES:
        return _spread_chart_svg(name, ranks, spread, width, height)
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    box = (min(xs), max(xs), min(ys), max(ys))
    body = _axes(width, height, f"{box[3]:.4g}", f"{box[2]:.4g}", f"step {box[0]:g}",
                 f"step {box[1]:g}")
    same = all(series[r] == series[ranks[0]] for r in ranks)
    if same:
        label = f"rank{'s' if len(ranks) > 1 else ''} {fmt_ranks(ranks)}" + \
            (" (equal)" if len(ranks) > 1 else "")
        body += _line(series[ranks[0]], box, RANK_COLOURS[0], width, height)
        title = f"{escape(name)} · {label}"
    elif len(ranks) <= MAX_LINES:
        title = escape(name) + " · " + ", ".join(
            f"<tspan fill='{rank_colour(r)}'>rank {r}</tspan>" for r in ranks)
        body += "".join(_line(series[r], box, rank_colour(r), width, height) for r in ranks)
    else:
        steps = sorted({x for x in xs})
        at = {r: dict(series[r]) for r in ranks}
        cols = [[at[r][x] for r in ranks if x in at[r]] for x in steps]
        body += "".join(_line([(x, f(c)) for x, c in zip(steps, cols)], box, colour, width,
                              height)
                        for f, colour in ((min, "#bbb"), (max, "#bbb"),
                                          (statistics.median, RANK_COLOURS[0])))
        title = (f"{escape(name)} · median of ranks {fmt_ranks(ranks)} "
                 f"(<tspan fill='#999'>min, max</tspan>)")
    last = {r: series[r][-1][1] for r in ranks}
    hover = f"{name}, latest: " + ", ".join(f"rank {r} {v:.4g}" for r, v in last.items())
    return _svg("nbdist-scalar-chart", width, height, title, hover, body)


def _spread_chart_svg(name: str, ranks: Sequence[int],
                      spread: Sequence[tuple[float, float, float, float]],
                      width: int, height: int) -> str:
    """Many ranks' logged value: its median over the ranks per step, with min and max (one
    line labelled "equal" where every rank logged the same)."""
    box = (spread[0][0], spread[-1][0], min(p[1] for p in spread), max(p[3] for p in spread))
    body = _axes(width, height, f"{box[3]:.4g}", f"{box[2]:.4g}", f"step {box[0]:g}",
                 f"step {box[1]:g}")
    if all(lo == hi for _, lo, _, hi in spread):
        body += _line([(x, med) for x, _, med, _ in spread], box, RANK_COLOURS[0], width,
                      height)
        title = f"{escape(name)} · ranks {fmt_ranks(ranks)} (equal)"
    else:
        body += "".join(_line([(p[0], p[i]) for p in spread], box, colour, width, height)
                        for i, colour in ((1, "#bbb"), (3, "#bbb"), (2, RANK_COLOURS[0])))
        title = (f"{escape(name)} · median of ranks {fmt_ranks(ranks)} "
                 f"(<tspan fill='#999'>min, max</tspan>)")
    x, lo, med, hi = spread[-1]
    hover = (f"{name} at step {x:g}: median {med:.4g}, min {lo:.4g}, max {hi:.4g} "
             f"over {len(ranks)} ranks")
    return _svg("nbdist-scalar-chart", width, height, title, hover, body)


def charts(snap: RunSnapshot, static: bool = False) -> str:
    """Step time, bandwidth and every logged value, side by side where the cell is wide:
    SVG, or ``static``, images with their words over them (what a saved notebook keeps:
    :mod:`nbdist.display.static_charts`)."""
    svgs = [step_chart_svg(snap.series, marks=snap.marks), bandwidth_chart_svg(snap.series)]
    svgs += [scalar_chart_svg(k, v, spread=snap.scalar_spread.get(k))
             for k, v in snap.scalar_series.items()]
    svgs = [static_chart(s) if static else s for s in svgs if s]
    if not svgs:
        return ""
    if static:  # inline blocks, not flex's wrap and gap: sanitizers drop styles they don't know
        return "<div>" + "".join(
            f"<div style='display:inline-block;vertical-align:top;margin:0 12px 4px 0'>{s}"
            "</div>" for s in svgs) + "</div>"
    return ("<div style='display:flex;flex-wrap:wrap;gap:4px 12px;align-items:flex-start'>"
            + "".join(svgs) + "</div>")


def summary_sections(snap: RunSnapshot) -> list[str]:
    """The parts of a run's static summary, in order, one per line ("" where the run has
    none); the parts that draw numbers only when it recorded some."""
    numbers = snap.has_telemetry
    return [
        run_header(snap, final=snap.finished),
        _part("nbdist-stall-box", stall(snap)),
        _part("nbdist-rows", run_table_html(snap) if numbers else ""),
        _part("nbdist-memory", detail_tables(snap)),
        verdicts(snap),
        failures(snap),
        legend() if numbers else "",
        _part("nbdist-chart", charts(snap, static=True)),
    ]


def _part(cls: str, html: str) -> str:
    """A part in a box of the class its widget has, so that the summary reads as the
    dashboard it replaces ("" stays "")."""
    return f"<div class='{cls}'>{html}</div>" if html else ""


def run_summary(snap: RunSnapshot) -> str:
    """A static summary of a run (header, table, pipeline, mesh dimensions and memory per
    rank, legend, charts) that renders without widgets, and whole where HTML is sanitized:
    no SVG, no script, the charts as PNG images."""
    # the dashboard's class too: at a run's end this summary takes the live widget's place
    return (f"<div class='nbdist-summary nbdist-dashboard'>{''.join(summary_sections(snap))}"
            "</div>")


def detail_tables(snap: RunSnapshot) -> str:
    """The pipeline's stages, collectives by mesh dimension and what each rank holds; each
    only when the run has it."""
    return "".join(html_table(t, caption=c) for t, c in (
        (pipeline_table(snap), ""), (dims_table(snap), ""), (memory_table(snap), MEMORY_CAPTION))
        if t is not None)
