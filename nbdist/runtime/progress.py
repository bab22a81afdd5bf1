"""The user API inside a ``%%distributed`` cell: :class:`progress` and :func:`log`.

``nbdist.progress`` and ``nbdist.log`` resolve here, so the notebook imports this module too and
it must not load torch; it reports to :mod:`.measure.model`, which is torch-free as well. Outside a
cell with telemetry on, ``progress`` is a plain iterator and ``log`` does nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, Optional

from ..telemetry import events as ev
from .measure.model import measurements

# How often a progress bar reports its position (seconds); the end is always reported.
_PROGRESS_EVERY = 0.1


class progress:
    """Iterate with a progress bar merged across ranks in the notebook (like ``tqdm``).

    Outside a ``%%distributed`` cell it is a plain iterator. Without a DDP model in the cell,
    each iteration counts as a training step (time per step, samples/s from the batch size).
    A plain ``tqdm`` bar in a cell is shown the same way, without the step counting.

    Parameters
    ----------
    iterable : iterable, optional
        What to iterate over. Without it, call :meth:`update` by hand.
    total : int, optional
        Number of items; taken from ``len(iterable)`` when it has one.
    desc : str
        Label shown next to the bar.

    Examples
    --------
    >>> for x, y in nbdist.progress(loader, desc="epoch 1"):   # doctest: +SKIP
    ...     loss = train_step(x, y)
    """

    def __init__(self, iterable: Optional[Iterable[Any]] = None, total: Optional[int] = None,
                 desc: str = ""):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total = total
        self.desc = desc
        self.n = 0
        measurements.bars += 1
        self.bar = measurements.bars
        self._sent = 0.0
        self._report(time.time())

    def _report(self, now: float, done: bool = False) -> None:
        if measurements.enabled:
            self._sent = now
            measurements.emit(ev.progress(self.bar, self.desc, self.n, self.total, now, done))

    def update(self, n: int = 1) -> None:
        """Advance the bar by ``n`` items."""
        self.n += n
        now = time.time()
        if now - self._sent >= _PROGRESS_EVERY or (self.total is not None
                                                    and self.n >= self.total):
            self._report(now)

    def close(self) -> None:
        """Report the bar as finished."""
        self._report(time.time(), done=True)

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("progress() without an iterable: call update() instead")
        it = iter(self.iterable)
        try:
            while True:
                t0 = time.time()
                try:
                    item = next(it)
                except StopIteration:
                    if measurements.enabled and not measurements.ddp_seen and measurements.step:
                        measurements.close_step(t0)
                    return
                if measurements.enabled:
                    measurements.on_iteration(item, t0)
                yield item
                self.update()
        finally:
            self.close()

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this progress bar has no total")
        return self.total

    def __enter__(self) -> progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def log(step: Optional[int] = None, **values: Any) -> None:
    """Show the latest values (``loss=...``, ``acc=...``) in the notebook's dashboard.

    Tensors are turned into numbers with ``.item()``, which waits for the GPU: log every few
    steps rather than every step when that matters.
    """
    if not measurements.enabled:
        return
    out: dict[str, float] = {}
    for k, v in values.items():
        if hasattr(v, "item"):
            v = v.item()
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError):
            continue  # non-numeric values have no place in a chart
    if step is None and measurements.step is not None:
        step = measurements.step.n
    measurements.emit(ev.scalars(out, time.time(), step))
