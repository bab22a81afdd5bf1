"""The view of one run under its cell: workers' output as it arrives, and a dashboard.

It draws what it is given and holds no numbers of its own: the Session owns the run's record
(:class:`nbdist.telemetry.run.Run`) and passes snapshots in.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Callable, Optional, Protocol

from ..telemetry.events import Batch, figures_interval
from .refresh import Throttle
from .text import NoteLines, StreamView

if TYPE_CHECKING:
    from ..telemetry.snapshot import RunSnapshot


class Dashboard(Protocol):
    """What every run dashboard (text lines, widgets) implements."""

    #: seconds between redraws while the run goes on
    interval: float

    def update(self, snap: RunSnapshot) -> None:
        """Redraw with the run's numbers now."""

    def close(self, snap: RunSnapshot) -> None:
        """The final redraw; the dashboard stays on screen as it is."""


class RunView:
    """Streams output under the cell and keeps a dashboard up to date, rate-limited.

    The Session calls :meth:`output` with every drained batch and :meth:`refresh` on every
    pass (from the kernel's main thread, about ten times a second: the clocks it draws tick
    whether events arrive or not), and :meth:`close` once.

    The dashboard redraws no more often than a rank of a run of ``world_size`` ranks sends
    its figures (:func:`~nbdist.telemetry.events.figures_interval`: every 4 s at a thousand
    ranks, 16 s at sixteen thousand), and a redraw may take at most :attr:`MAX_BUSY_SHARE`
    of the kernel's time: when one costs more (a run of a thousand ranks on a slow machine),
    the next waits longer.
    """

    MAX_BUSY_SHARE = 0.03

    def __init__(self, stream: StreamView, dashboard: Optional[Dashboard] = None,
                 world_size: int = 0):
        self.stream = stream
        self.dashboard = dashboard
        #: seconds between redraws at least: its own interval, or the ranks' if longer
        self.interval = max(dashboard.interval if dashboard is not None else 1.0,
                            figures_interval(world_size) if world_size else 0.0)
        self._throttle = Throttle(self.interval)
        #: CPU seconds the last redraw took (snapshot and drawing)
        self.last_cost = 0.0
        self._notes = NoteLines()  # with no dashboard, what happened is still said

    def output(self, batches: Iterable[Batch]) -> None:
        """Write the workers' stdout/stderr that these batches carry."""
        self.stream.feed(batches)

    def refresh(self, snapshot: Callable[[], RunSnapshot], force: bool = False) -> None:
        """Redraw the dashboard if it is due (or ``force``: news that cannot wait, such as the
        hang doctor's verdict or a rank found dead); ``snapshot`` is only called then."""
        if self.dashboard is None:
            if force:
                self._notes.show(snapshot())
            return
        if self._throttle.due() or force:
            t0 = time.thread_time()
            self.dashboard.update(snapshot())
            self.last_cost = time.thread_time() - t0
            self._throttle.interval = max(self.interval, self.last_cost / self.MAX_BUSY_SHARE)

    def close(self, snap: RunSnapshot) -> None:
        """End unfinished output lines and draw the final dashboard."""
        self.stream.close()
        if self.dashboard is not None:
            self.dashboard.close(snap)
        else:
            self._notes.show(snap)
