"""When a run counts as stalled: the thresholds the hang doctor shares between the workers
(:mod:`nbdist.runtime.measure.stall_probe`, which decides when to say where a rank is) and the
notebook (:mod:`.report`, which gives the verdict).

A leaf: stdlib only, so the worker runtime reads these rules without loading the notebook's
verdict module.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Optional

#: the least time without progress that counts as a stall (seconds)
STALL_FLOOR_S = 10.0
#: ... or this many median steps, when steps are longer
STALL_STEPS = 5.0
#: steps whose median sets the threshold (the most recent)
STALL_WINDOW = 20
#: the least time without progress the dashboard mentions, quietly, before any verdict
QUIET_FLOOR_S = 2.0
#: ... or this many median steps, when steps are longer
QUIET_STEPS = 3.0


def stall_threshold(step_s: Iterable[float], override: Optional[float] = None
                    ) -> Optional[float]:
    """Seconds without progress that make a stall; None when the user switched it off.

    ``override`` (``--stall-after S``) wins; 0 switches the hang doctor off. Otherwise
    :data:`STALL_STEPS` times the median of ``step_s`` (recent step durations), at least
    :data:`STALL_FLOOR_S`.

    >>> stall_threshold([0.1, 0.2, 4.0])
    10.0
    >>> stall_threshold([3.0, 3.0]), stall_threshold([], 2.5), stall_threshold([], 0)
    (15.0, 2.5, None)
    """
    if override is not None:
        return float(override) if override > 0 else None
    steps = list(step_s)
    median = statistics.median(steps) if steps else 0.0
    return max(STALL_FLOOR_S, STALL_STEPS * median)


def quiet_after(step_s: Iterable[float]) -> float:
    """Seconds without progress after which the dashboard says so ("no step for 3 s"), long
    before the hang doctor's threshold: :data:`QUIET_STEPS` median steps, at least
    :data:`QUIET_FLOOR_S`.

    >>> quiet_after([0.1, 0.2]), quiet_after([2.0])
    (2.0, 6.0)
    """
    steps = list(step_s)
    return max(QUIET_FLOOR_S, QUIET_STEPS * statistics.median(steps)) if steps else QUIET_FLOOR_S


def probe_after(threshold: float) -> float:
    """How long a worker waits without progress before it first says where it is: early
    enough that its report is in when the notebook's threshold passes."""
    return max(0.2, threshold / 2)
