"""Ranks stopped for the notebook: in the debugger, or in ``input()``, waiting for the user.

Pure, stdlib only. Workers send a ``debugger`` event when they stop (``"enter"``) and when they
go on (``"leave"``), see :func:`~nbdist.telemetry.events.debugger`; the hang doctor's verdict
(:mod:`.stall.report`) reads :class:`Stops` to say "rank 1 is in the debugger (line 5)" instead of
judging a hang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

#: a rank's status in a verdict while it waits for the notebook
DEBUGGING = "debugging"


@dataclass(frozen=True)
class Stopped:
    """A rank stopped for the notebook: in the debugger (``mode`` ``"pdb"``) or in
    ``input()``, at ``line`` of ``file`` (a cell's), in ``func``."""

    rank: int
    mode: str
    file: str = ""
    line: Optional[int] = None
    func: str = ""

    @property
    def doing(self) -> str:
        return "the debugger" if self.mode == "pdb" else "input()"

    def describe(self) -> str:
        """``rank 1 is in the debugger (line 5)``."""
        what = "is in the debugger" if self.mode == "pdb" else "waits for input()"
        at = f"line {self.line}" if self.line is not None else ""
        if self.func and not self.func.startswith("<"):
            at += f", in {self.func}"
        return f"rank {self.rank} {what}" + (f" ({at})" if at else "")


class Stops:
    """Where each rank stopped for the notebook now, innermost last (an ``input()`` typed
    inside the debugger stops a rank twice)."""

    def __init__(self) -> None:
        self._by_rank: dict[int, list[Stopped]] = {}

    def feed(self, rank: int, event: dict[str, Any]) -> Optional[float]:
        """Take a ``debugger`` event; returns the time ``rank`` went on, for a ``"leave"``."""
        state = event.get("state")
        if state == "enter":
            self._by_rank.setdefault(rank, []).append(
                Stopped(rank, str(event.get("mode", "pdb")), str(event.get("file", "")),
                        event.get("line"), str(event.get("func", ""))))
        elif state == "leave":
            stops = self._by_rank.get(rank)
            if stops:
                stops.pop()
            if not stops:
                self._by_rank.pop(rank, None)
            return float(event.get("t", 0.0))
        return None

    def end(self, rank: int) -> None:
        """``rank``'s call ended: it waits for nothing any more."""
        self._by_rank.pop(rank, None)

    def of(self, rank: int) -> Optional[Stopped]:
        stops = self._by_rank.get(rank)
        return stops[-1] if stops else None

    def now(self) -> tuple[Stopped, ...]:
        """Each stopped rank's innermost stop, by rank."""
        return tuple(stops[-1] for _, stops in sorted(self._by_rank.items()))

    def __bool__(self) -> bool:
        return bool(self._by_rank)
