"""Accelerate on a rank: what ``accelerator.log`` logs, in nbdist's dashboard.

``Accelerator.log`` hands values to the trackers named in ``log_with``, on the main process
only. While a cell with telemetry runs, :func:`activate` wraps the method on the class, so
that every rank's call reports its values as the rank's logged values first (each rank's
own: the dashboard shows their spread), then runs Accelerate's own; :func:`deactivate` puts
the method back when the cell ends. Values that are not numbers (text, lists) stay out.

Steps and samples come from the DDP model ``accelerator.prepare`` makes
(:mod:`nbdist.runtime.measure.ddp_hooks`), and a ``tqdm`` loop is the rank's progress
(:mod:`nbdist.runtime.measure.tqdm_bars`), as for a loop without Accelerate.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from . import report


def activate() -> None:
    """Wrap ``Accelerator.log`` so that it reports to nbdist too."""
    cls = sys.modules["accelerate.accelerator"].Accelerator
    original = cls.__dict__["log"]
    if getattr(original, "_nbdist_original", None) is not None:
        return

    @functools.wraps(original)
    def log(self: Any, values: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(values, dict):
            report.values(values)
        return original(self, values, *args, **kwargs)

    log._nbdist_original = original  # type: ignore[attr-defined]
    cls.log = log


def deactivate() -> None:
    """Put Accelerate's own ``Accelerator.log`` back."""
    module = sys.modules.get("accelerate.accelerator")
    if module is None:
        return
    cls = module.Accelerator
    original = getattr(cls.__dict__.get("log"), "_nbdist_original", None)
    if original is not None:
        cls.log = original
