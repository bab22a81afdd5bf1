"""What elastic training went through in a run, kept as it happened.

The notebook's half of elastic training (:mod:`nbdist.elastic.coordinator`) writes what it
decides as records: a :class:`Lost` rank the moment it finds the rank's worker gone, and a
:class:`Recovery` when the group re-formed, a replacement joined, or the run stopped. A cell
without elastic training writes a :class:`Lost` rank too, for each worker the engine lost
during the cell (:mod:`nbdist.cell.loop`). The run's record
(:class:`~nbdist.telemetry.run.Run`) takes both; its fold keeps each as a :class:`Mark` at the
step where it happened, so the chart can draw a rule there instead of redrawing history.

A replacement worker reports as the rank it replaces, counting its steps from 0 in its own
process; :class:`Incarnations` knows which worker a rank's events come from and at which step
of the job the current one joined (the coordinator's ``JOINED`` :class:`Recovery` says), so its
steps keep the job's numbering and its numbers stay apart from those of the worker it replaced.
Pure: no clocks, no processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from .units import fmt_ranks, fmt_seconds

__all__ = ["Incarnations", "Lost", "Mark", "Recovery", "RecoveryKind"]


class RecoveryKind(str, Enum):
    """What a :class:`Recovery` records."""

    FAILURE = "failure"  # ranks were lost and the others re-formed (or are re-forming)
    JOINED = "joined"  # a replacement worker healed into the group
    STOPPED = "stopped"  # the run ended, or gave up on a replacement: ``why``


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


@dataclass(frozen=True)
class Lost:
    """A rank whose worker is gone, as the notebook found it at ``t`` (seconds since the
    epoch)."""

    t: float
    rank: Optional[int]
    host: Optional[str] = None
    pid: Optional[int] = None
    cause: Optional[str] = None  # "SIGKILL", "exit status 1"; None: unknown
    #: who found it, the first word of its line: elastic training's coordinator, or
    #: ``nbdist`` (the cell loop, for a worker the engine lost outside elastic training)
    by: str = "nbdist.elastic"
    #: the cell line it was running (``line 2 of In [5]``), where a fatal signal's dump of
    #: its stack said, or the rank's record of its line (``the start of In [5]`` before the
    #: record saw one); None where nothing said (it was between cells, or nothing was read)
    cell_line: Optional[str] = None
    #: the last lines it wrote to stderr, as its host kept them
    tail: tuple[str, ...] = ()
    #: where its stderr is kept, where the notebook could not read it (another host)
    kept_at: Optional[str] = None
    #: ``cell_line`` is where the rank was last seen (its record, up to 50 ms old: SIGKILL,
    #: the out-of-memory killer), not where it died (a dump, ``os._exit``'s call)
    line_seen: bool = False

    def __str__(self) -> str:
        where = f"rank {'?' if self.rank is None else self.rank} on {self.host or '?'}" + (
            f" (pid {self.pid})" if self.pid else "")
        return f"{where} died" + (f": {self.reason}" if self.cause or self.cell_line else "")

    @property
    def reason(self) -> str:
        """What the rank's row, its error and ``%nbdist status`` say after ``died:``: the
        cause and the cell line it was running (``SIGABRT at line 2 of In [5]``; ``SIGKILL,
        last seen at line 7 of In [5]`` where the line is the rank's last record of it), else
        that its worker is gone."""
        if not self.cell_line:
            return self.cause or "its worker is gone"
        if self.line_seen:
            return ", ".join(x for x in (self.cause, f"last seen at {self.cell_line}") if x)
        return " ".join(x for x in (self.cause, f"at {self.cell_line}") if x)

    def gone(self) -> str:
        """The death as the rank's error says it: ``its worker (pid 41) died: SIGKILL``, or
        ``its worker (pid 41) is gone`` where the cause is unknown."""
        worker = f"its worker (pid {self.pid})" if self.pid else "its worker"
        return f"{worker} died: {self.reason}" if self.cause or self.cell_line else \
            f"{worker} is gone"

    def said(self) -> str:
        """Its last lines on stderr, indented under a line that says so ("" where there are
        none), or where they are kept."""
        if self.tail:
            return "its last lines on stderr:\n" + "".join(f"    {ln}\n" for ln in self.tail)
        return f"its stderr is kept in {self.kept_at}\n" if self.kept_at else ""

    def line(self) -> str:
        return f"{self.by} {_clock(self.t)}: {self}"


@dataclass
class Recovery:
    """One failure an elastic run survived (or did not), or one replacement that joined."""

    t: float
    kind: RecoveryKind
    lost: list[Lost] = field(default_factory=list)
    world_before: int = 0
    world_after: int = 0
    commit: Optional[int] = None
    discarded: int = 0  # optimizer steps thrown away (done after the commit restored)
    seconds: Optional[float] = None  # from the failure to steps flowing again
    why: Optional[str] = None
    #: ``JOINED``: the rank (slot) the replacement reports as, and the job's step it starts
    #: at (None: after the latest step any rank reported)
    rank: Optional[int] = None
    step: Optional[int] = None

    def line(self) -> str:
        """What happened, in one line (a :class:`Lost` rank has a line of its own)."""
        when = _clock(self.t)
        if self.kind is RecoveryKind.JOINED:
            took = f" in {fmt_seconds(self.seconds)}" if self.seconds is not None else ""
            return (f"nbdist.elastic {when}: a replacement worker joined at commit "
                    f"{self.commit}{took}, healed from a live peer; world "
                    f"{self.world_before} -> {self.world_after}")
        if self.kind is RecoveryKind.STOPPED:
            return f"nbdist.elastic {when}: stopped: {self.why}"
        ranks = [x.rank for x in self.lost if x.rank is not None]
        who = (f"the group re-formed without rank{'s' if len(ranks) > 1 else ''} "
               f"{fmt_ranks(ranks)}" if ranks else "a collective failed")
        back = (f"rolled back to commit {self.commit} ({self.discarded} optimizer step"
                f"{'s' if self.discarded != 1 else ''} repeated)" if self.commit is not None
                else "re-forming")
        took = f", healed in {fmt_seconds(self.seconds)}" if self.seconds is not None else ""
        return (f"nbdist.elastic {when}: {who}; {back}{took}; world {self.world_before} -> "
                f"{self.world_after}")


@dataclass(frozen=True)
class Mark:
    """Something that happened to the job, at the step where it happened.

    ``kind`` is ``"died"``, ``"re-formed"``, ``"joined"`` or ``"stopped"``; ``step`` is the
    job's step it happened before (None: before any step was known); ``text`` says it whole.
    """

    t: float
    kind: str
    text: str
    step: Optional[int] = None
    rank: Optional[int] = None

    @property
    def label(self) -> str:
        """What the chart's rule says: ``rank 1 died``, ``replacement joined``."""
        if self.kind == "died":
            return f"rank {self.rank} died" if self.rank is not None else "a rank died"
        if self.kind == "joined":
            return "replacement joined"
        return "re-formed" if self.kind == "re-formed" else "stopped"

    @property
    def failure(self) -> bool:
        """Drawn in the failure colour (else the recovery colour)."""
        return self.kind in ("died", "stopped")


class Incarnations:
    """Which worker each rank's events come from, and where in the job's steps it began."""

    def __init__(self) -> None:
        #: rank -> the job's step the rank's current worker counts its steps from
        self.offset: dict[int, int] = {}
        self.marks: list[Mark] = []

    def joined(self, news: Recovery, fallback: int) -> Optional[int]:
        """A replacement worker now reports as ``news.rank`` (a ``JOINED`` record): the job's
        step it starts at (the record's ``step``, else ``fallback``); None for a record that
        names no rank."""
        if news.kind is not RecoveryKind.JOINED or news.rank is None:
            return None
        start = fallback if news.step is None else int(news.step)
        self.offset[news.rank] = start
        return start

    def mark(self, t: float, kind: str, text: str, step: Optional[int] = None,
             rank: Optional[int] = None) -> None:
        self.marks.append(Mark(t, kind, text, step, rank))

    def record(self, news: Any, died_at: Optional[int], joined_at: Optional[int]) -> None:
        """A :class:`Lost` or :class:`Recovery` the notebook wrote: a mark (``died_at``: the
        job's step after the lost rank's last one; ``joined_at``: where the latest
        replacement started)."""
        if isinstance(news, Lost):
            self.mark(news.t, "died", news.line(), died_at, news.rank)
        elif news.kind is RecoveryKind.JOINED:
            self.mark(news.t, "joined", news.line(), joined_at)
        else:
            kind = "stopped" if news.kind is RecoveryKind.STOPPED else "re-formed"
            self.mark(news.t, kind, news.line(), died_at)
