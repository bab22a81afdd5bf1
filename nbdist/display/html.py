"""Static HTML: what stays readable in a saved notebook (GitHub, nbviewer).

All of nbdist's markup and colours live here; the widgets set their values from these
functions. Remote text (host names, error messages, progress labels) is always escaped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import TYPE_CHECKING, Callable, Optional

from ..telemetry.units import fmt_bytes, fmt_bytes_rate, fmt_rate, fmt_seconds
from .tables import (
    Table,
    comparison_table,
    dims_table,
    memory_table,
    pipeline_table,
    run_table,
    status_rows,
)

if TYPE_CHECKING:
    from ..records import ClusterStatus
    from ..telemetry.aggregate import RankSnapshot, RunSnapshot, StepPoint
    from ..telemetry.compare import RunFigures

#: chart series: compute time, exposed all-reduce time, all-reduce bandwidth; the axis line
COMPUTE, EXPOSED, BANDWIDTH, AXIS = "#4c78a8", "#f58518", "#54a24b", "#888"
#: a failed rank, a dead worker, an action that did not work
FAIL = "#c00"
#: a straggler: slower than the others, not broken
WARN = "#b60"


def bold(text: str) -> str:
    """``text``, escaped, in bold."""
    return f"<b>{escape(text)}</b>"


def error_text(message: str) -> str:
    """``message``, escaped, in the failure colour."""
    return f"<span style='color:{FAIL}'>{escape(message)}</span>"


def warning_text(message: str) -> str:
    """``message``, escaped, in bold in the straggler colour."""
    return f"<b style='color:{WARN}'>{escape(message)}</b>"


def table(t: Table) -> str:
    """A :class:`~nbdist.display.tables.Table` as an HTML table; broken rows in red."""
    head = "".join(f"<th>{escape(c)}</th>" for c in t.header)
    body = "".join((f"<tr style='color:{FAIL}'>" if row.broken else "<tr>")
                   + "".join(f"<td>{escape(c)}</td>" for c in row.cells) + "</tr>"
                   for row in t.rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# ----------------------------------------------------------------- cluster
def status_table(status: ClusterStatus) -> str:
    """An HTML table of a :class:`~nbdist.records.ClusterStatus`."""
    head = (f"<b>nbdist</b> {escape(status.engine)}: {status.alive}/{status.wanted} workers alive"
            + (f", backend <code>{escape(status.dist_backend)}</code>" if status.dist_backend
               else "")
            + (f", MASTER_ADDR <code>{escape(status.master)}</code>" if status.master else ""))
    return f"<div class='nbdist-status'><p>{head}</p>{table(status_rows(status))}</div>"


#: shown under the cluster panel's Scale control
SCALE_NOTE = ("<small>Scaling re-forms the process group at the new size before the next "
              "<code>%%distributed</code> cell. Rebuild what depends on the world size: "
              "DistributedDataParallel models, optimizers, samplers and data loaders. Workers "
              "that stay keep their namespace; new workers start empty (re-run set-up cells "
              "or <code>%nbdist push</code>).</small>")


# ----------------------------------------------------------------- run telemetry
def run_header(state: str, line: Optional[str] = None) -> str:
    """The live dashboard's first line: the run's state, then its one-line summary."""
    return f"<b>nbdist</b> {escape(state)}" + (f" · {escape(line)}" if line is not None else "")


def step_chart_svg(series: Sequence[StepPoint], width: int = 420, height: int = 120) -> str:
    """Stacked bars per step: compute time under exposed all-reduce time (seconds)."""
    pts = list(series)[-120:]
    top = max((p.step_s for p in pts), default=0.0)
    if not pts or top <= 0:
        return ""
    pad_l, pad_b = 60, 16
    w, h = width - pad_l - 4, height - pad_b - 14
    bw = w / len(pts)
    bars = []
    for i, p in enumerate(pts):
        x = pad_l + i * bw
        hc = h * max(0.0, p.compute_s) / top
        he = h * max(0.0, p.exposed_s) / top
        y_c = 14 + h - hc
        tip = (f"step {p.step}: {fmt_seconds(p.step_s)}, exposed all-reduce "
               f"{fmt_seconds(p.exposed_s)}")
        bars.append(f"<g><title>{escape(tip)}</title>"
                    f"<rect x='{x:.1f}' y='{y_c:.1f}' width='{max(bw - 1, 0.5):.1f}' "
                    f"height='{hc:.1f}' fill='{COMPUTE}'/>"
                    f"<rect x='{x:.1f}' y='{y_c - he:.1f}' width='{max(bw - 1, 0.5):.1f}' "
                    f"height='{he:.1f}' fill='{EXPOSED}'/></g>")
    return (f"<svg class='nbdist-step-chart' xmlns='http://www.w3.org/2000/svg' "
            f"width='{width}' height='{height}' viewBox='0 0 {width} {height}' "
            f"font-family='sans-serif' font-size='10'>"
            f"<text x='{pad_l}' y='10'>step time: <tspan fill='{COMPUTE}'>compute</tspan> + "
            f"<tspan fill='{EXPOSED}'>exposed all-reduce</tspan></text>"
            f"<text x='{pad_l - 4}' y='{14 + 8}' text-anchor='end'>{fmt_seconds(top)}</text>"
            f"<text x='{pad_l - 4}' y='{14 + h}' text-anchor='end'>0</text>"
            f"<line x1='{pad_l}' y1='{14 + h}' x2='{width - 4}' y2='{14 + h}' stroke='{AXIS}'/>"
            + "".join(bars)
            + f"<text x='{pad_l}' y='{height - 3}'>step {pts[0].step}</text>"
            f"<text x='{width - 4}' y='{height - 3}' text-anchor='end'>step {pts[-1].step}"
            f"</text></svg>")


def bandwidth_chart_svg(series: Sequence[StepPoint], width: int = 420, height: int = 90) -> str:
    """All-reduce algorithm bandwidth per step, as a line."""
    pts = [p for p in list(series)[-120:] if p.bandwidth]
    if not pts:
        return ""
    top = max(p.bandwidth or 0.0 for p in pts)
    lo, hi = pts[0].step, max(pts[-1].step, pts[0].step + 1)
    pad_l, pad_b = 60, 16
    w, h = width - pad_l - 4, height - pad_b - 14
    xy = " ".join(f"{pad_l + w * (p.step - lo) / (hi - lo):.1f},"
                  f"{14 + h - h * (p.bandwidth or 0.0) / top:.1f}" for p in pts)
    return (f"<svg class='nbdist-allreduce-chart' xmlns='http://www.w3.org/2000/svg' "
            f"width='{width}' height='{height}' viewBox='0 0 {width} {height}' "
            f"font-family='sans-serif' font-size='10'>"
            f"<text x='{pad_l}' y='10'>all-reduce bandwidth per step</text>"
            f"<text x='{pad_l - 4}' y='{14 + 8}' text-anchor='end'>"
            f"{escape(fmt_bytes_rate(top))}</text>"
            f"<line x1='{pad_l}' y1='{14 + h}' x2='{width - 4}' y2='{14 + h}' stroke='{AXIS}'/>"
            f"<polyline fill='none' stroke='{BANDWIDTH}' stroke-width='1.5' points='{xy}'/>"
            f"<text x='{pad_l}' y='{height - 3}'>step {lo}</text>"
            f"<text x='{width - 4}' y='{height - 3}' text-anchor='end'>step {pts[-1].step}"
            f"</text></svg>")


def charts(series: Sequence[StepPoint]) -> str:
    """The step-time chart, then the bandwidth chart (either empty when there is no data)."""
    return step_chart_svg(series) + bandwidth_chart_svg(series)


def rank_stats(r: RankSnapshot) -> str:
    """One rank's numbers as HTML (escaped): progress, rates, comm share, failure reason."""
    parts = []
    if r.bar is not None:
        b = r.bar
        label = f"{escape(b.desc)} " if b.desc else ""
        parts.append(f"{label}{b.n}/{b.total}" if b.total is not None else f"{label}{b.n}")
        if b.rate is not None:
            parts.append(fmt_rate(b.rate, "it/s"))
        if b.eta_s is not None:
            parts.append(f"ETA {fmt_seconds(b.eta_s)}")
    if r.steps:
        parts.append(f"{r.steps} steps")
        if r.steps_per_s is not None:
            parts.append(fmt_rate(r.steps_per_s, "steps/s"))
        if r.samples_per_s:
            parts.append(fmt_rate(r.samples_per_s, "samples/s"))
        if r.step_s is not None:
            frac = r.exposed_fraction
            share = f" ({frac:.0%} exposed comm)" if frac is not None else ""
            parts.append(f"step {fmt_seconds(r.step_s)}{share}")
        if r.bandwidth is not None:
            parts.append(fmt_bytes_rate(r.bandwidth))
    if r.pipeline is not None:
        parts.append(f"{r.pipeline.label} · bubble {r.pipeline.bubble:.0%}")
    if r.memory is not None:
        parts.append(f"holds {fmt_bytes(r.memory.training)}")
    text = " · ".join(parts)
    if r.straggler:
        text += " · " + warning_text("straggler")
    if r.state.broken:
        text += " · " + error_text(f"{r.state}: {r.error or r.state}")
    return f"<span class='nbdist-rank-stats'>{text}</span>"


def scalars_line(values: Mapping[str, float]) -> str:
    """The latest logged values, ``name value`` with the value in bold."""
    return " · ".join(f"{escape(str(k))} {bold(f'{v:.4g}')}" for k, v in values.items())


def run_summary(snap: RunSnapshot) -> str:
    """A static summary of a run (table + SVG charts) that renders without widgets."""
    head = (f"<b>nbdist run</b>: {len(snap.ranks)} ranks, {snap.steps} steps, "
            f"{fmt_seconds(snap.elapsed_s)}")
    if snap.stragglers:
        head += " · " + warning_text("straggler: rank "
                                     + ", ".join(str(r) for r in snap.stragglers))
    if snap.scalars:
        head += " · " + scalars_line(snap.scalars)
    if snap.bubble is not None:
        head += f" · pipeline bubble {bold(f'{snap.bubble:.0%}')}"
    extra = "".join(table(t) for t in (pipeline_table(snap), dims_table(snap),
                                       memory_table(snap)) if t is not None)
    return (f"<div class='nbdist-summary'><p>{head}</p>{table(run_table(snap))}{extra}"
            f"<div>{charts(snap.series)}</div></div>")


def _bars_svg(title: str, items: Sequence[tuple[str, float]], fmt: Callable[[float], str],
              color: str, width: int = 420) -> str:
    """Horizontal bars, one per run, labelled with the run's name and its value."""
    if not items or max(v for _, v in items) <= 0:
        return ""
    top = max(v for _, v in items)
    pad_l, bar_h = 110, 16
    height = 18 + bar_h * len(items)
    w = width - pad_l - 70
    rows = []
    for i, (name, v) in enumerate(items):
        y = 16 + i * bar_h
        rows.append(f"<text x='{pad_l - 4}' y='{y + 11}' text-anchor='end'>{escape(name)}</text>"
                    f"<rect x='{pad_l}' y='{y + 2}' width='{w * v / top:.1f}' height='{bar_h - 4}'"
                    f" fill='{color}'/><text x='{pad_l + w * v / top + 4:.1f}' y='{y + 11}'>"
                    f"{escape(fmt(v))}</text>")
    return (f"<svg class='nbdist-compare-chart' xmlns='http://www.w3.org/2000/svg' "
            f"width='{width}' height='{height}' viewBox='0 0 {width} {height}' "
            f"font-family='sans-serif' font-size='10'><text x='{pad_l}' y='10'>{escape(title)}"
            f"</text>{''.join(rows)}</svg>")


def comparison(runs: Sequence[RunFigures]) -> str:
    """Named runs side by side: the table, then throughput and memory per rank as bars."""
    speed = [(r.name, r.samples_per_s) for r in runs if r.samples_per_s]
    held = [(r.name, float((r.params or 0) + (r.grads or 0) + (r.optimizer or 0)))
            for r in runs if r.params is not None]
    chart = (_bars_svg("samples/s (all ranks)", speed, lambda v: fmt_rate(v), COMPUTE)
             + _bars_svg("params + grads + optimizer state per rank", held, fmt_bytes, EXPOSED))
    return (f"<div class='nbdist-compare'>{table(comparison_table(runs))}<div>{chart}</div>"
            "</div>")
