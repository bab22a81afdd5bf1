"""How a start looks while its workers come up: ``starting 17 workers: 5 of 17 ready``.

The backend's wait calls the view with ``(ready, wanted)`` as workers register; the view draws
one line under the cell and updates it in place (a static output: it reads the same in a saved
notebook). Where no kernel can update a display (terminal IPython, plain Python) it draws
nothing: the status after the start says what came up.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from ..table_layout import MUTED
from ..telemetry.units import fmt_seconds


class StartProgress:
    """Called with ``(ready, wanted)``; shows one line, updated in place."""

    def __init__(self, show: Callable[..., Any], clock: Callable[[], float] = time.monotonic):
        self._show = show  # IPython's display
        self._clock = clock
        self._t0 = clock()
        self._handle: Any = None
        self.text = ""

    def __call__(self, ready: int, wanted: int) -> None:
        took = fmt_seconds(self._clock() - self._t0)
        if ready >= wanted:
            self.text = f"nbdist: {ready} of {wanted} workers ready in {took}"
        else:
            self.text = f"nbdist: starting {wanted} workers: {ready} of {wanted} ready ({took})"
        bundle = {"text/plain": self.text,
                  "text/html": f"<div class='nbdist-start' style='color:{MUTED}'>{self.text}"
                               f"</div>"}
        if self._handle is None:
            self._handle = self._show(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)


def start_progress(kernel: bool) -> Optional[StartProgress]:
    """A :class:`StartProgress` where a Jupyter kernel can update a display (``kernel``)."""
    if not kernel:
        return None
    from IPython.display import display  # deferred: only a live kernel draws this

    return StartProgress(display)
