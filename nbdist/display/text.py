"""Text views: the baseline that works everywhere (terminal IPython, nbconvert, logs)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Callable, Optional, TextIO

import nbdist.display.tables as tables

from ..table_layout import text_table
from ..telemetry.events import STREAM, Batch
from .refresh import Throttle

if TYPE_CHECKING:
    from ..telemetry.snapshot import RunSnapshot


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
        self._last_rank: dict[str, int] = {}

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
        pieces = []
        last = self._last_rank.get(name)
        if last is not None and last != rank and not self._at_line_start.get((last, name), True):
            # Another rank's line is unfinished: end it rather than splice two ranks together.
            pieces.append("\n")
            self._at_line_start[(last, name)] = True
        self._last_rank[name] = rank
        start = self._at_line_start.get(key, True)
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
        self._last_rank.clear()


# ----------------------------------------------------------------- run telemetry
class NoteLines:
    """Prints what happened to a run (its notes: a rank died, a replacement joined) as it
    happens, each line once."""

    def __init__(self, stream: Optional[TextIO] = None) -> None:
        self._stream = stream
        self.printed = 0

    def show(self, snap: RunSnapshot) -> int:
        """Print the notes not printed yet; return how many."""
        new = snap.notes[self.printed:]
        if new:
            out = self._stream or sys.stdout
            out.write("".join(line + "\n" for line in new))
            out.flush()
            self.printed = len(snap.notes)
        return len(new)


def format_line(snap: RunSnapshot, prefix: str = "nbdist: ", final: bool = False) -> str:
    """One line for a run: state, pace, where the step time goes, failures."""
    parts = tables.progress_phrases(snap, final) + tables.diagnosis_phrases(snap)
    return prefix + " | ".join(parts + tables.failure_lines(snap))


def format_summary(snap: RunSnapshot, notes: bool = True) -> str:
    """A plain table of a finished run, one row per rank (or min/median/max and outliers),
    then the pipeline's stages, collectives by mesh dimension and what each rank holds, and
    what happened to the run (its notes; ``notes=False`` where they were printed already)."""
    head = "nbdist run: " + " | ".join(tables.progress_phrases(snap, final=snap.finished)
                                       + tables.diagnosis_phrases(snap))
    extra = []
    for table, caption in ((tables.pipeline_table(snap), ()), (tables.dims_table(snap), ()),
                           (tables.memory_table(snap), (tables.MEMORY_CAPTION,))):
        if table is not None:
            extra += ["", *caption, *text_table(table)]
    stall = tables.stall_lines(snap)
    if stall:
        extra += ["", *stall]
    if notes and snap.notes:
        extra += ["", *snap.notes]
    said = tables.verdict_lines(snap)
    if said:
        extra += ["", *(f"verdict: {line}" for line in said)]
    return "\n".join([head, *text_table(tables.run_table(snap)), *extra])


class TextDashboard:
    """The no-widget dashboard: a line every ``interval`` seconds, then a summary.

    Without a ``stream``, ``show`` may show the summary as a rich output instead (it returns
    False where it cannot): :func:`~nbdist.display.make_run_view` passes
    :func:`~nbdist.display.summary.show_summary`, plain text with static HTML under IPython,
    so a notebook executed by nbconvert keeps a table and chart that GitHub renders.
    """

    interval: float = 5.0

    def __init__(self, stream: Optional[TextIO] = None, interval: Optional[float] = None,
                 show: Optional[Callable[[RunSnapshot], bool]] = None):
        if interval is not None:
            self.interval = interval
        self._stream = stream
        self._show = show
        self._throttle = Throttle(self.interval)
        self.lines = 0
        self._last = ""
        self._stall: Optional[tuple] = None  # the verdict printed last
        self._notes = NoteLines(stream)

    def update(self, snap: RunSnapshot) -> None:
        self.lines += self._notes.show(snap)
        self._print_stall(snap)
        if snap.has_telemetry and self._throttle.due():
            self._print(format_line(snap))

    def _print_stall(self, snap: RunSnapshot) -> None:
        """The hang doctor's verdict, as soon as it appears or changes (not on the line's
        schedule): it is what the user needs while a cell hangs."""
        key = snap.stall.key if snap.stall is not None else None
        if key != self._stall and key is not None:
            self._print("\n".join("nbdist: " + line if i == 0 else "  " + line
                                  for i, line in enumerate(tables.stall_lines(snap))))
        self._stall = key

    def close(self, snap: RunSnapshot) -> None:
        self.lines += self._notes.show(snap)
        if not snap.has_telemetry:
            return
        line = format_line(snap, final=True)
        if line != self._last:
            self._print(line)
        shown = self._stream is None and self._show is not None and self._show(snap)
        if not shown:
            self._print(format_summary(snap, notes=False))  # printed as they came

    def _print(self, text: str) -> None:
        self._last = text
        out = self._stream or sys.stdout
        out.write(text + "\n")
        out.flush()
        self.lines += 1
