"""Static HTML: what stays readable in a saved notebook (GitHub, nbviewer). Remote text escaped."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from ..telemetry.units import fmt_bytes_rate, fmt_rate, fmt_seconds


def status_table(status: Any) -> str:
    """An HTML table of a :class:`~nbdist.records.ClusterStatus`."""
    head = (f"<b>nbdist</b> {escape(status.engine)}: {status.alive}/{status.wanted} workers alive"
            + (f", backend <code>{escape(status.dist_backend)}</code>" if status.dist_backend
               else "")
            + (f", MASTER_ADDR <code>{escape(status.master)}</code>" if status.master else ""))
    cells = ("rank", "host", "pid", "device", "alive", "mem MB", "state")
    rows = []
    for r in status.rows:
        color = "" if r.alive else ' style="color:#c00"'
        values = (r.rank if r.rank is not None else "-", r.hostname, r.pid or "-",
                  r.device or "-", "yes" if r.alive else "no",
                  f"{r.rss_mb:.0f}" if r.rss_mb is not None else "-", r.state)
        rows.append(f"<tr{color}>" + "".join(f"<td>{escape(str(v))}</td>" for v in values)
                    + "</tr>")
    header = "".join(f"<th>{c}</th>" for c in cells)
    return (f"<div class='nbdist-status'><p>{head}</p><table><thead><tr>{header}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>")


# ----------------------------------------------------------------- run telemetry
_COMPUTE, _EXPOSED, _LINE, _FAIL = "#4c78a8", "#f58518", "#54a24b", "#c00"


def step_chart_svg(series: Sequence[Any], width: int = 420, height: int = 120) -> str:
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
                    f"height='{hc:.1f}' fill='{_COMPUTE}'/>"
                    f"<rect x='{x:.1f}' y='{y_c - he:.1f}' width='{max(bw - 1, 0.5):.1f}' "
                    f"height='{he:.1f}' fill='{_EXPOSED}'/></g>")
    return (f"<svg class='nbdist-step-chart' xmlns='http://www.w3.org/2000/svg' "
            f"width='{width}' height='{height}' viewBox='0 0 {width} {height}' "
            f"font-family='sans-serif' font-size='10'>"
            f"<text x='{pad_l}' y='10'>step time: <tspan fill='{_COMPUTE}'>compute</tspan> + "
            f"<tspan fill='{_EXPOSED}'>exposed all-reduce</tspan></text>"
            f"<text x='{pad_l - 4}' y='{14 + 8}' text-anchor='end'>{fmt_seconds(top)}</text>"
            f"<text x='{pad_l - 4}' y='{14 + h}' text-anchor='end'>0</text>"
            f"<line x1='{pad_l}' y1='{14 + h}' x2='{width - 4}' y2='{14 + h}' stroke='#888'/>"
            + "".join(bars)
            + f"<text x='{pad_l}' y='{height - 3}'>step {pts[0].step}</text>"
            f"<text x='{width - 4}' y='{height - 3}' text-anchor='end'>step {pts[-1].step}"
            f"</text></svg>")


def bandwidth_chart_svg(series: Sequence[Any], width: int = 420, height: int = 90) -> str:
    """All-reduce algorithm bandwidth per step, as a line."""
    pts = [p for p in list(series)[-120:] if p.bandwidth]
    if not pts:
        return ""
    top = max(p.bandwidth for p in pts)
    lo, hi = pts[0].step, max(pts[-1].step, pts[0].step + 1)
    pad_l, pad_b = 60, 16
    w, h = width - pad_l - 4, height - pad_b - 14
    xy = " ".join(f"{pad_l + w * (p.step - lo) / (hi - lo):.1f},"
                  f"{14 + h - h * p.bandwidth / top:.1f}" for p in pts)
    return (f"<svg class='nbdist-allreduce-chart' xmlns='http://www.w3.org/2000/svg' "
            f"width='{width}' height='{height}' viewBox='0 0 {width} {height}' "
            f"font-family='sans-serif' font-size='10'>"
            f"<text x='{pad_l}' y='10'>all-reduce bandwidth per step</text>"
            f"<text x='{pad_l - 4}' y='{14 + 8}' text-anchor='end'>"
            f"{escape(fmt_bytes_rate(top))}</text>"
            f"<line x1='{pad_l}' y1='{14 + h}' x2='{width - 4}' y2='{14 + h}' stroke='#888'/>"
            f"<polyline fill='none' stroke='{_LINE}' stroke-width='1.5' points='{xy}'/>"
            f"<text x='{pad_l}' y='{height - 3}'>step {lo}</text>"
            f"<text x='{width - 4}' y='{height - 3}' text-anchor='end'>step {pts[-1].step}"
            f"</text></svg>")


def rank_stats(r: Any) -> str:
    """One rank's numbers as HTML (escaped): progress, rates, comm share, failure reason."""
    parts = []
    if r.bar is not None:
        b = r.bar
        label = f"{escape(b.desc)} " if b.desc else ""
        parts.append(f"{label}{b.n}/{b.total}" if b.total is not None else f"{label}{b.n}")
        if b.rate is not None:
            parts.append(f"{fmt_rate(b.rate, 'it/s')}")
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
    text = " · ".join(parts)
    if r.straggler:
        text += " · <b style='color:#b60'>straggler</b>"
    if r.state == "failed" or r.state == "stopped":
        reason = escape(r.error or r.state)
        text += f" · <span style='color:{_FAIL}'>{escape(r.state)}: {reason}</span>"
    return f"<span class='nbdist-rank-stats'>{text}</span>"


def scalars_line(values: dict) -> str:
    return " · ".join(f"{escape(str(k))} <b>{v:.4g}</b>" for k, v in values.items())


def run_summary(snap: Any) -> str:
    """A static summary of a run (table + SVG charts) that renders without widgets."""
    head = (f"<b>nbdist run</b>: {len(snap.ranks)} ranks, {snap.steps} steps, "
            f"{fmt_seconds(snap.elapsed_s)}")
    if snap.stragglers:
        head += (" · <b style='color:#b60'>straggler: rank "
                 + ", ".join(str(r) for r in snap.stragglers) + "</b>")
    if snap.scalars:
        head += " · " + scalars_line(snap.scalars)
    cols = ("rank", "state", "steps", "steps/s", "samples/s", "step", "exposed comm",
            "all-reduce bw")
    rows = []
    for r in snap.ranks:
        frac = r.exposed_fraction
        state = r.state + (f": {r.error}" if r.error else "")
        values = (r.rank, state, r.steps, fmt_rate(r.steps_per_s), fmt_rate(r.samples_per_s),
                  fmt_seconds(r.step_s), f"{frac:.0%}" if frac is not None else "-",
                  fmt_bytes_rate(r.bandwidth))
        color = f" style='color:{_FAIL}'" if r.state in ("failed", "stopped") else ""
        rows.append(f"<tr{color}>" + "".join(f"<td>{escape(str(v))}</td>" for v in values)
                    + "</tr>")
    header = "".join(f"<th>{c}</th>" for c in cols)
    charts = step_chart_svg(snap.series) + bandwidth_chart_svg(snap.series)
    return (f"<div class='nbdist-summary'><p>{head}</p><table><thead><tr>{header}</tr>"
            f"</thead><tbody>{''.join(rows)}</tbody></table><div>{charts}</div></div>")
