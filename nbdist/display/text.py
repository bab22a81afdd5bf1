"""Text views: the baseline that works everywhere (terminal IPython, nbconvert, logs)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, Optional, TextIO

from ..telemetry.events import STREAM, Batch


class StreamView:
    """Writes workers' stdout/stderr under the cell, each line prefixed with its rank.

    ``mode`` is ``"rank0"`` (only ``shown_rank``), ``"all"`` or ``"quiet"``.
    """

    def __init__(self, mode: str = "rank0", shown_rank: int = 0,
                 stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None):
        self.mode = mode
        self.shown_rank = shown_rank
        self._out = {"stdout": stdout, "stderr": stderr}
        self._at_line_start: dict[tuple[int, str], bool] = {}

    def _stream(self, name: str) -> TextIO:
        # Looked up at write time: IPython swaps sys.stdout per cell.
        return self._out.get(name) or (sys.stderr if name == "stderr" else sys.stdout)

    def feed(self, batches: Iterable[Batch]) -> None:
        for batch in sorted(batches, key=lambda b: (b["seq"], b["rank"])):
            rank = batch["rank"]
            if self.mode == "quiet" or (self.mode == "rank0" and rank != self.shown_rank):
                continue
            for ev in batch["events"]:
                if ev["kind"] == STREAM:
                    self._write(rank, ev["name"], ev["text"])

    def _write(self, rank: int, name: str, text: str) -> None:
        key = (rank, name)
        prefix = f"[{rank}] "
        start = self._at_line_start.get(key, True)
        pieces = []
        for line in text.splitlines(True):
            pieces.append((prefix if start else "") + line)
            start = line.endswith("\n")
        self._at_line_start[key] = start
        stream = self._stream(name)
        stream.write("".join(pieces))
        stream.flush()

    def close(self) -> None:
        for (_rank, name), start in self._at_line_start.items():
            if not start:
                self._stream(name).write("\n")
        self._at_line_start.clear()


def format_status(status: Any) -> str:
    """A plain table of a :class:`~nbdist.records.ClusterStatus`."""
    head = (f"nbdist cluster: {status.engine}, {status.alive}/{status.wanted} workers alive"
            + (f", backend {status.dist_backend}" if status.dist_backend else "")
            + (f", MASTER_ADDR {status.master}" if status.master else ""))
    cols = ("rank", "host", "pid", "device", "alive", "mem MB", "state")
    rows = [(str(r.rank) if r.rank is not None else "-", r.hostname, str(r.pid or "-"),
             r.device or "-", "yes" if r.alive else "NO",
             f"{r.rss_mb:.0f}" if r.rss_mb is not None else "-", r.state)
            for r in status.rows]
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c)
              for i, c in enumerate(cols)]
    lines = [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
