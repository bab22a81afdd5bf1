"""Plain records users hold: a cluster's status and a rank's displayed value."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class WorkerRow:
    """One worker in a :class:`ClusterStatus`."""

    rank: Optional[int]  # None: a worker outside the current rank plan
    worker: str  # the engine's id for it
    hostname: str
    pid: Optional[int]
    device: Optional[str]
    alive: bool
    rss_mb: Optional[float] = None  # resident memory in MiB
    state: str = "idle"  # "idle", "busy" (alive, no status reply: in a cell) or "gone"


@dataclass(frozen=True)
class ClusterStatus:
    """What ``%nbdist status`` shows: wanted vs. observed workers, one row per worker."""

    engine: str
    wanted: int
    rows: tuple[WorkerRow, ...] = field(default_factory=tuple)
    dist_backend: Optional[str] = None
    master: Optional[str] = None

    @property
    def alive(self) -> int:
        return sum(r.alive for r in self.rows)

    # Views are imported when drawn, not at import time: display names these types itself.
    def __repr__(self) -> str:
        from .display.text import format_status

        return format_status(self)

    def _repr_html_(self) -> str:
        from .display.html import status_table

        return status_table(self)


class RemoteValue:
    """The last expression of a ``%%distributed`` cell, as rank ``rank`` displayed it.

    Holds the display data only; use ``nbdist.pull(name)`` to bring the object itself back.
    """

    def __init__(self, rank: int, bundle: dict[str, Any]):
        self.rank = rank
        self.data = bundle

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return dict(self.data)

    def __repr__(self) -> str:
        return str(self.data.get("text/plain", ""))

    def _repr_html_(self) -> Optional[str]:
        return self.data.get("text/html") or f"<pre>{html.escape(repr(self))}</pre>"
