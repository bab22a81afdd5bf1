"""Workers' output as people read it: per rank, merged with identical lines folded, warnings once.

:class:`RankLines` and :class:`WarningLog` are pure models (no IPython, no widgets) that the
views draw: ``--all-output`` shows every rank's lines as a tab per rank plus an "all ranks" tab
where a line several ranks printed alike appears once, as ``[0-3] epoch 1 done``; a warning
raised on several ranks is shown once, naming them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, TextIO

from ..telemetry.events import DISPLAY, STREAM, WARNING, Batch, Event
from ..telemetry.units import fmt_ranks
from .output_html import OutputLine, rank_output_html, warnings_html
from .refresh import Throttle
from .rich_output import RichOutput
from .text import StreamView

#: lines kept per rank (and in the merged view); older ones are dropped first
MAX_LINES = 10_000
#: lines drawn per tab of the live view; the saved notebook's static view has them all
SHOWN_LINES = 500


def rank_label(ranks: Iterable[int]) -> str:
    """``[0-1]``, ``[0,2-3]``: the prefix of a line or warning that these ranks printed."""
    return f"[{fmt_ranks(ranks).replace(', ', ',')}]"


def _overwrite(line: str) -> str:
    """What a terminal shows for ``line``: the text after its last carriage return."""
    line = line[:-1] if line.endswith("\r") else line
    return line.rsplit("\r", 1)[-1]


@dataclass(frozen=True)
class Line:
    """One line of a rank's output, without its newline."""

    stream: str  # "stdout" or "stderr"
    text: str


class RankLines:
    """Each rank's output split into lines, and a merged view with identical lines folded.

    A line joins the earliest merged line with the same text (and stream) that its rank has
    not printed yet and that comes after that rank's previous line, so every rank's own order
    is kept and ranks printing the same lines fold line by line.
    """

    def __init__(self, max_lines: int = MAX_LINES) -> None:
        self.max_lines = max_lines
        self._lines: dict[int, list[Line]] = {}
        self._dropped: dict[int, int] = {}
        self._partial: dict[tuple[int, str], str] = {}
        self._merged: list[tuple[Line, set[int]]] = []
        self._base = 0  # id of self._merged[0]; ids stay valid after old lines are dropped
        self._index: dict[Line, list[int]] = {}
        self._last: dict[int, int] = {}  # rank -> id of the last merged line it is in
        #: bumped on every change, so views redraw only what changed
        self.version = 0
        self.changed: set[int] = set()

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self._lines) | {r for r, _ in self._partial})

    def feed(self, rank: int, stream: str, text: str) -> None:
        """Add a chunk of ``rank``'s ``stream`` (any piece of text, lines or not)."""
        if not text:
            return
        key = (rank, stream)
        *complete, rest = (self._partial.get(key, "") + text).split("\n")
        for raw in complete:
            self._add(rank, Line(stream, _overwrite(raw)))
        self._partial[key] = rest
        self._touch(rank)

    def close(self) -> None:
        """End unfinished lines (the run is over)."""
        for (rank, stream), rest in sorted(self._partial.items()):
            if rest:
                self._add(rank, Line(stream, _overwrite(rest)))
                self._touch(rank)
        self._partial.clear()

    def lines(self, rank: int) -> list[Line]:
        """``rank``'s lines so far, its unfinished line last."""
        out = list(self._lines.get(rank, []))
        out += [Line(s, _overwrite(t)) for (r, s), t in sorted(self._partial.items())
                if r == rank and t]
        return out

    def dropped(self, rank: Optional[int] = None) -> int:
        """Lines dropped for the cap, of ``rank`` (None: of the merged view)."""
        return self._base if rank is None else self._dropped.get(rank, 0)

    def merged(self) -> list[tuple[tuple[int, ...], Line]]:
        """Every finished line once, with the ranks that printed it, in order of arrival."""
        return [(tuple(sorted(ranks)), line) for line, ranks in self._merged]

    def _touch(self, rank: int) -> None:
        self.version += 1
        self.changed.add(rank)

    def _add(self, rank: int, line: Line) -> None:
        lines = self._lines.setdefault(rank, [])
        lines.append(line)
        if len(lines) > self.max_lines:
            del lines[0]
            self._dropped[rank] = self._dropped.get(rank, 0) + 1
        ids = self._index.setdefault(line, [])
        after = self._last.get(rank, -1)
        i = bisect.bisect_right(ids, after)
        # Every merged line this rank is in has an id <= after, so the first later one with
        # the same text is free for it.
        while i < len(ids) and ids[i] < self._base:
            i += 1
        if i < len(ids):
            mid = ids[i]
            self._merged[mid - self._base][1].add(rank)
        else:
            mid = self._base + len(self._merged)
            self._merged.append((line, {rank}))
            ids.append(mid)
        self._last[rank] = mid
        if len(self._merged) > self.max_lines:
            old, _ = self._merged.pop(0)
            self._base += 1
            stale = self._index.get(old)
            if stale and stale[0] < self._base:
                stale.pop(0)
                if not stale:
                    del self._index[old]


def _tail(rows: list, dropped: int, last: Optional[int]) -> tuple[list, list[OutputLine]]:
    """The ``last`` of ``rows``, after a line saying how many earlier ones are not shown."""
    skipped = dropped + (max(0, len(rows) - last) if last is not None else 0)
    if last is not None:
        rows = rows[-last:] if last else []
    return rows, [("stdout", f"... {skipped} earlier lines")] if skipped else []


def merged_lines(lines: RankLines, last: Optional[int] = None) -> list[OutputLine]:
    """The merged view: ``[0-1] epoch 1 done`` lines with their stream (the ``last`` only)."""
    rows, head = _tail(lines.merged(), lines.dropped(), last)
    return head + [(line.stream, f"{rank_label(r)} {line.text}") for r, line in rows]


def rank_lines(lines: RankLines, rank: int, last: Optional[int] = None) -> list[OutputLine]:
    """``rank``'s own lines with their stream, unprefixed (the ``last`` ones only)."""
    rows, head = _tail(lines.lines(rank), lines.dropped(rank), last)
    return head + [(line.stream, line.text) for line in rows]


def merged_text(lines: RankLines, last: Optional[int] = None) -> str:
    """The merged view as text (see :func:`merged_lines`)."""
    return "\n".join(text for _, text in merged_lines(lines, last))


def rank_text(lines: RankLines, rank: int, last: Optional[int] = None) -> str:
    """``rank``'s own lines as text (see :func:`rank_lines`)."""
    return "\n".join(text for _, text in rank_lines(lines, rank, last))


# ----------------------------------------------------------------- warnings
@dataclass(frozen=True)
class Warned:
    """One distinct warning (category, message, where) and the ranks that raised it."""

    category: str
    message: str
    filename: str
    lineno: int
    ranks: tuple[int, ...]

    def __str__(self) -> str:
        return (f"{rank_label(self.ranks)} {self.filename}:{self.lineno}: "
                f"{self.category}: {self.message}")


class WarningLog:
    """Warnings from the ranks, each kept once with the ranks that raised it."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str, str, int], set[int]] = {}

    def add(self, rank: int, event: Event) -> bool:
        """Record ``event`` (a ``warning`` event) from ``rank``; True if something changed."""
        key = (event["category"], event["message"], event["filename"], event["lineno"])
        ranks = self._seen.setdefault(key, set())
        if rank in ranks:
            return False
        ranks.add(rank)
        return True

    def items(self) -> list[Warned]:
        return [Warned(*key, tuple(sorted(ranks))) for key, ranks in self._seen.items()]

    def __bool__(self) -> bool:
        return bool(self._seen)

    def text(self) -> str:
        return "\n".join(str(w) for w in self.items())


# ----------------------------------------------------------------- the view
def _kernel_display() -> Any:
    """IPython's ``display`` where a Jupyter kernel runs (output can be updated in place)."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        return None
    shell = get_ipython()
    return display if shell is not None and getattr(shell, "kernel", None) is not None else None


class _Updatable:
    """One display under the cell, drawn once and updated in place."""

    def __init__(self) -> None:
        self.handle: Any = None

    def show(self, bundle: dict[str, Any]) -> bool:
        display = _kernel_display()
        if display is None:
            return False
        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)
        return True


class OutputView(StreamView):
    """Workers' stdout/stderr under the cell, and their warnings, each shown once.

    ``mode`` is ``"rank0"`` (``shown_rank``'s output streams live), ``"all"`` or ``"quiet"``.
    With ``per_rank`` (the widget medium), ``"all"`` shows a tab per rank and an "all ranks"
    tab with identical lines folded, redrawn every ``interval`` seconds; the saved notebook
    keeps the merged text and a static per-rank view. Otherwise every rank's lines stream,
    prefixed. Warnings from every rank (not only the shown one) are shown once each with the
    ranks that raised them, updated in place as more ranks report one.
    """

    interval = 0.25

    def __init__(self, mode: str = "rank0", shown_rank: int = 0, *,
                 ranks: Sequence[int] = (), per_rank: bool = False,
                 stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None) -> None:
        super().__init__(mode, shown_rank, stdout, stderr)
        self.warnings = WarningLog()
        self._warned = _Updatable()
        self.lines: Optional[RankLines] = RankLines() if per_rank and mode == "all" else None
        self._ranks = list(ranks)
        self._panel: Any = None
        self._shown = _Updatable()
        self._throttle = Throttle(self.interval)
        self.rich = RichOutput(mode, shown_rank, stdout)  # what the ranks displayed

    def feed(self, batches: Iterable[Batch]) -> None:
        if self.mode == "quiet":
            return
        batches = sorted(batches, key=lambda b: (b["seq"], b["rank"]))
        warned = False
        for batch in batches:
            for ev in batch["events"]:
                if ev["kind"] == WARNING:
                    warned |= self.warnings.add(batch["rank"], ev)
                elif ev["kind"] == STREAM and self.lines is not None:
                    self.lines.feed(batch["rank"], ev["name"], ev["text"])
        if self.lines is None:
            super().feed(batches)
        elif self.lines.changed and self._throttle.due():
            self._draw_panel(final=False)
        for batch in batches:  # after the batch's lines, as the rank wrote them
            for ev in batch["events"]:
                if ev["kind"] == DISPLAY:
                    self.rich.feed(batch["rank"], ev)
        if warned:
            self._warned.show(self._warnings_bundle())

    def close(self) -> None:
        super().close()
        if self.lines is not None:
            self.lines.close()
            if self.lines.ranks:
                self._draw_panel(final=True)
        if self.warnings and not self._warned.show(self._warnings_bundle()):
            out = self._stream("stderr")  # no kernel to update a display in: say it once now
            out.write(self.warnings.text() + "\n")
            out.flush()

    def _warnings_bundle(self) -> dict[str, Any]:
        text = self.warnings.text()
        return {"text/plain": text, "text/html": warnings_html(text.splitlines())}

    def _draw_panel(self, final: bool) -> None:
        assert self.lines is not None
        if self._panel is None:
            from .output_widget import RankOutputTabs  # deferred: only the widget medium

            self._panel = RankOutputTabs(sorted(set(self._ranks) | set(self.lines.ranks)))
        self._panel.show(merged_lines(self.lines, last=SHOWN_LINES),
                         {r: rank_lines(self.lines, r, last=SHOWN_LINES)
                          for r in self.lines.changed})
        self.lines.changed.clear()
        if self._shown.handle is None or final:
            # A saved notebook has no widget state: it keeps the merged text and a static
            # per-rank view, brought up to date when the run ends.
            self._shown.show({
                **self._panel._repr_mimebundle_(),
                "text/plain": merged_text(self.lines),
                "text/html": rank_output_html(
                    merged_lines(self.lines),
                    [(r, rank_lines(self.lines, r)) for r in self.lines.ranks])})
        if final and self._shown.handle is None:  # no kernel after all: print it once
            out = self._stream("stdout")
            out.write(merged_text(self.lines) + "\n")
            out.flush()
