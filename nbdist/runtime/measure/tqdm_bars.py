"""A plain ``tqdm`` loop on the ranks becomes a live bar per rank in the notebook's dashboard.

People write progress with ``tqdm`` (or ``tqdm.auto``). Run on a worker, it would redraw itself
with carriage returns into the captured stderr (a scroll of ``\\r`` lines under the cell), or,
with ``tqdm.auto`` on an ipyparallel engine, draw an ipywidget that no front end ever sees.

:func:`install` (called when a worker joins the job) swaps the classes that ``tqdm``,
``tqdm.auto`` and ``tqdm.autonotebook`` export for subclasses built on tqdm's own extension
point, ``display()``, the way ``tqdm.notebook`` and ``tqdm.rich`` make their front ends: inside a
``%%distributed`` cell with telemetry on, a bar writes nothing and reports its position as the
same progress events :class:`nbdist.progress <nbdist.runtime.progress.progress>` sends.
Elsewhere (``--no-telemetry``, outside cells) it is tqdm, unchanged. Stdlib and tqdm only.
"""

from __future__ import annotations

import io
import sys
import time
import warnings
from typing import Any, Optional

from ...telemetry import events as ev
from .model import measurements

# How often a bar reports its position (seconds); its end is always reported.
_EVERY = 0.1


class _Nowhere(io.TextIOBase):
    """Where a reporting bar writes its text: nothing is kept."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return len(text)


def _reporting(base: type) -> type:
    """A subclass of tqdm class ``base`` that reports to nbdist inside a telemetry cell."""

    class RankBar(base):  # type: ignore[misc, valid-type]
        __doc__ = base.__doc__

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._nbdist_bar: Optional[int] = None
            self._nbdist_sent = 0.0
            if measurements.enabled:
                measurements.bars += 1
                self._nbdist_bar = measurements.bars
                kwargs["file"] = _Nowhere()  # no "\r" redraws into the cell's stderr
                kwargs.pop("gui", None)
            super().__init__(*args, **kwargs)

        def display(self, msg: Optional[str] = None, pos: Optional[int] = None) -> Any:
            if self._nbdist_bar is None:
                return super().display(msg, pos)
            self._nbdist_report()
            return True

        def close(self) -> None:
            report = self._nbdist_bar is not None and not getattr(self, "disable", True)
            super().close()
            if report:
                self._nbdist_report(done=True)

        def _nbdist_report(self, done: bool = False) -> None:
            now = time.time()
            n = int(getattr(self, "n", 0) or 0)
            total = self.total
            total = int(total) if total is not None and total == total else None  # NaN: none
            at_end = total is not None and n >= total
            if done or at_end or now - self._nbdist_sent >= _EVERY:
                self._nbdist_sent = now
                measurements.emit(ev.progress(self._nbdist_bar or 0, str(self.desc or ""), n,
                                           total, now, done))

    RankBar.__name__ = RankBar.__qualname__ = base.__name__
    RankBar.__module__ = base.__module__
    return RankBar


def _trange(cls: type) -> Any:
    def trange(*args: Any, **kwargs: Any) -> Any:
        """``tqdm(range(*args), **kwargs)``."""
        return cls(range(*args), **kwargs)

    return trange


def install() -> bool:
    """Make ``tqdm``, ``tqdm.auto`` and ``tqdm.autonotebook`` bars report to nbdist.

    Idempotent; does nothing (and returns False) where tqdm is not installed. Only the names
    those modules export change, so code that imports them gets the reporting bars; tqdm's
    internals (``tqdm.std``) are left as they are.
    """
    try:
        import tqdm
        import tqdm.asyncio
        import tqdm.std

        with warnings.catch_warnings():  # tqdm.auto may warn about its notebook mode
            warnings.simplefilter("ignore")
            import tqdm.auto
    except ImportError:
        return False
    if getattr(tqdm, "_nbdist_installed", False):
        return True
    plain = _reporting(tqdm.std.tqdm)
    # tqdm.auto's class also iterates asynchronously; on an ipyparallel engine it would be
    # tqdm.notebook's widget bar, which no front end displays from there.
    auto = _reporting(tqdm.asyncio.tqdm_asyncio)
    tqdm.tqdm, tqdm.trange = plain, _trange(plain)
    tqdm.auto.tqdm, tqdm.auto.trange = auto, _trange(auto)
    for name in ("tqdm.autonotebook", "tqdm.notebook"):
        module = sys.modules.get(name)
        if module is not None:
            module.tqdm, module.trange = plain, _trange(plain)  # type: ignore[attr-defined]
    tqdm._nbdist_installed = True  # type: ignore[attr-defined]
    return True
