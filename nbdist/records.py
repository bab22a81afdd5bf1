"""Plain records users hold: a cluster's status and a rank's displayed value."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from .telemetry.compare import RunFigures


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


class Comparison:
    """Named runs side by side (``nbdist.compare()``, ``%nbdist compare``).

    ``runs`` holds one :class:`~nbdist.telemetry.compare.RunFigures` per run. It shows itself
    as an HTML table with a chart, and :meth:`to_pandas` gives the numbers as a DataFrame.
    """

    def __init__(self, runs: list[RunFigures]):
        self.runs = list(runs)

    def to_pandas(self) -> Any:
        """A DataFrame indexed by run name: numeric columns with units in their labels, then
        the last logged values. Raises ImportError without pandas."""
        import pandas as pd

        from .telemetry.compare import COLUMNS

        scalar_keys = sorted({k for r in self.runs for k in r.scalars})
        rows = [[*r.values(), *(r.scalars.get(k) for k in scalar_keys)] for r in self.runs]
        labels = [label for _attr, label, _scale in COLUMNS] + scalar_keys
        frame = pd.DataFrame(rows, columns=labels, index=[r.name for r in self.runs])
        frame.index.name = "run"
        return frame

    def __repr__(self) -> str:
        from .display.text import format_comparison

        return format_comparison(self.runs)

    def _repr_html_(self) -> str:
        from .display.html import comparison

        return comparison(self.runs)
