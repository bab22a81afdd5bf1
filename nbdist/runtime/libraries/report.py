"""How a library's values and progress reach the rank's telemetry: the same events
:func:`nbdist.log <nbdist.runtime.progress.log>` and
:class:`nbdist.progress <nbdist.runtime.progress.progress>` send, so the dashboard, the run's
record and the verdicts read them as theirs. Shared by the library modules of this package;
torch-free (tensors are read through their ``.item()``)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any, Optional

from ...telemetry import events as ev
from ..measure.model import measurements

# How often a library's bar reports its position (seconds), as nbdist.progress; its end and
# its last item are always reported.
_EVERY = 0.1


def numbers(values: Mapping[Any, Any], skip: frozenset[str] = frozenset()) -> dict[str, float]:
    """The numeric items of ``values`` as floats (tensors and numpy scalars through
    ``.item()``); strings, booleans, lists and the names in ``skip`` are left out.

    >>> numbers({"loss": 0.5, "lr": 1, "note": "x", "epoch": 1.0}, frozenset({"epoch"}))
    {'loss': 0.5, 'lr': 1.0}
    """
    out: dict[str, float] = {}
    for k, v in values.items():
        name = str(k)
        if name in skip or isinstance(v, (bool, str)):
            continue
        if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
            try:
                v = v.item()
            except (TypeError, ValueError, RuntimeError):
                continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[name] = float(v)
    return out


def values(values: Mapping[Any, Any], skip: frozenset[str] = frozenset()) -> None:
    """Report ``values`` as the rank's logged values at its current step (a cell with
    telemetry on only)."""
    if not measurements.enabled:
        return
    out = numbers(values, skip)
    if out:
        step = measurements.step.n if measurements.step is not None else None
        measurements.emit(ev.scalars(out, time.time(), step))


class Bar:
    """A progress bar the library drives by position (``n`` of ``total``), reported as the
    rank's progress; it reports only inside a cell with telemetry on."""

    def __init__(self, total: Optional[int], desc: str = "") -> None:
        self.total = total if total is None or math.isfinite(total) else None
        self.desc = desc
        self.n = 0
        self.sent = 0.0
        self.bar: Optional[int] = None
        if measurements.enabled:
            measurements.bars += 1
            self.bar = measurements.bars
            self._send(time.time(), False)

    def _send(self, now: float, done: bool) -> None:
        self.sent = now
        measurements.emit(ev.progress(self.bar or 0, self.desc, self.n, self.total, now, done))

    def at(self, n: int) -> None:
        """The library is at item ``n``."""
        self.n = int(n)
        now = time.time()
        if self.bar is not None and measurements.enabled and (
                now - self.sent >= _EVERY or (self.total is not None and self.n >= self.total)):
            self._send(now, False)

    def close(self) -> None:
        """The library's loop ended."""
        if self.bar is not None and measurements.enabled:
            self._send(time.time(), True)
        self.bar = None
