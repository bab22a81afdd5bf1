"""What a run keeps of its ranks' events for a trace file (``%nbdist timeline``,
``Run.write_trace``): each rank's events as they came, up to :data:`MAX_RECORDED` in all, the
oldest dropped first; or, for a run that writes no trace (a job watched from outside), only
their count. Part of the run's fold (:mod:`.aggregate`); pure.
"""

from __future__ import annotations

import pickle
from collections import deque
from typing import Any

from .columns import unpack
from .events import TABLE, Event

__all__ = ["MAX_RECORDED", "Recorded"]

#: events kept per run for ``%nbdist timeline`` (older ones are dropped first)
MAX_RECORDED = 200_000


class Recorded:
    """A run's events kept for its trace, per rank.

    Parameters
    ----------
    trace : bool
        Keep the events (False: count them only, as :attr:`untraced`).
    """

    def __init__(self, trace: bool = True):
        self.trace = trace
        #: events folded and not kept (``trace=False``)
        self.untraced = 0
        #: rank -> what it sent, as ``(events, pickle)`` of each event, table or list of
        #: them (a sealed event's; the sealed event itself where its tables' rows are
        #: pickled apart)
        self.kept: dict[int, deque[tuple[int, Any]]] = {}
        #: events dropped because the run recorded more than :data:`MAX_RECORDED`
        self.dropped = 0
        self._held = 0  # events in ``kept``

    def add(self, rank: int, e: Event, n: int) -> None:
        """Keep ``e`` (``n`` events: a table holds several) of ``rank``, as its pickle: bytes
        the garbage collector never scans. At a thousand ranks, the events kept as dicts (and
        tables as dicts of lists) would make its full collections the notebook's largest
        cost."""
        if not self.trace:
            self.untraced += n
            return
        rec = self.kept.setdefault(rank, deque())
        if e["kind"] == TABLE:  # its rows, not the summaries the fold read
            e = {"kind": TABLE, "order": e["order"],
                 "parts": [{"of": p["of"], "fields": p["fields"], "columns": p["columns"]}
                           for p in e["parts"]]}
        self._keep(rec, n, pickle.dumps(e, pickle.HIGHEST_PROTOCOL))

    def add_sealed(self, rank: int, e: Event) -> None:
        """Keep a ``sealed`` event's events (:func:`~.columns.seal`) as they came: already a
        pickle (of their list; a table's summaries with its rows)."""
        if not self.trace:
            self.untraced += e["n"]
            return
        self._keep(self.kept.setdefault(rank, deque()), e["n"],
                   e["events"] if "rows" not in e else e)

    def _keep(self, rec: deque[tuple[int, Any]], n: int, blob: Any) -> None:
        rec.append((n, blob))
        self._held += n
        while self._held > MAX_RECORDED and rec:
            k = rec.popleft()[0]
            self._held -= k
            self.dropped += k

    @property
    def held(self) -> int:
        """Events kept now (0 once let go)."""
        return self._held

    def clear(self) -> None:
        """Let go of the kept events (the run's figures do not need them)."""
        self.kept.clear()
        self._held = 0

    def events(self) -> dict[int, list[Event]]:
        """The kept events per rank, tables expanded, in the order they came."""
        out: dict[int, list[Any]] = {}
        for r, kept in self.kept.items():
            out[r] = list(unpack(x for _, blob in kept for x in (
                [blob] if isinstance(blob, dict) else _listed(pickle.loads(blob)))))
        return out


def _listed(kept: Any) -> list[Event]:
    return kept if isinstance(kept, list) else [kept]
