"""Faults on purpose, a worker's half: ``%nbdist hang RANK`` holds this rank at its next
collective. (``%nbdist kill`` needs nothing here: the engine signals the process from outside,
see :mod:`nbdist.debugger.faults`.)

:func:`arm` leaves a number of seconds here; the collective wrappers of
:mod:`.measure.ddp_hooks` (every ``torch.distributed`` collective a cell calls, and the
forward of a DDP model, whose gradient all-reduce follows) look at :data:`armed` before anything
else, so the hold happens whether telemetry is on or off, before the rank takes part: its
peers wait in the collective for a rank that never reached it, as they would for a rank
stuck just before it. Stdlib only.
"""

from __future__ import annotations

import time
from typing import Optional

#: seconds the next collective on this worker is held for (None: not armed)
armed: Optional[float] = None
#: each sleep of a hold: an interrupt lands between two (on Dask it cannot cut one short)
STEP_S = 0.05


def arm(seconds: float) -> None:
    """Hold this worker's next collective for ``seconds``."""
    global armed
    armed = float(seconds)


def hang() -> None:
    """Hold here for the armed time, once (the hang doctor names this function as where the
    rank is: ``nbdist.runtime.faults.hang``)."""
    global armed
    seconds, armed = armed, None
    if not seconds:
        return
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(STEP_S, left))  # a hang made on purpose: an interrupt still lands
