"""The notebook's half of :mod:`nbdist.runtime.end_marks`: it marks the end of each rank
whose call has returned while a peer still runs, in the store the notebook hosts."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from ..boot.store_host import StoreError
from ..runtime.end_marks import end_key

if TYPE_CHECKING:
    from ..boot.store_host import StoreHost
    from ..telemetry.events import Batch


class EndMarks:
    """A companion of a cell's loop (:class:`nbdist.cell.loop.Companion`): on each pass, the
    ranks in ``ranks`` that no longer run get their end mark, once."""

    def __init__(self, store: StoreHost, cell_id: str, ranks: Sequence[int]) -> None:
        self.store, self.cell_id = store, cell_id
        self.unmarked = set(ranks)

    def feed(self, batches: Sequence[Batch]) -> None:
        pass

    def tick(self, running: Collection[int]) -> None:
        ended = self.unmarked.difference(running)
        try:
            for rank in sorted(ended):
                self.store.set(end_key(self.cell_id, rank), b"1")
        except StoreError:  # the store is gone: a failed rank then waits out its grace
            ended = self.unmarked
        self.unmarked -= ended

    def paused(self) -> float:
        return 0.0

    def close(self) -> None:
        pass
