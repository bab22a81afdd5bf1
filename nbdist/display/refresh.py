"""The one rate limit every live view uses: redraw at most a few times per second."""

from __future__ import annotations

import time
from typing import Callable, Optional


class Throttle:
    """Says when enough time has passed since the last redraw.

    Views are fed from the kernel's main thread every ~0.1 s; drawing on each feed would flood
    the front end with widget messages (or the log with lines), so they ask :meth:`due` first.
    """

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.clock = clock
        self._last: Optional[float] = None

    def due(self) -> bool:
        """True (and the clock restarts) when ``interval`` has passed since the last True."""
        now = self.clock()
        if self._last is None or now - self._last >= self.interval:
            self._last = now
            return True
        return False
