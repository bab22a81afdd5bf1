"""Static HTML: what stays readable in a saved notebook (GitHub, nbviewer). Remote text escaped."""

from __future__ import annotations

from html import escape
from typing import Any


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
