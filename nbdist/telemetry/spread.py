"""Logged values: each rank's curves, and over many ranks, per step, their min, median and
max (the chart above a few ranks). Part of the run's fold (:mod:`.aggregate`); pure."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

from .ranks import RankFold

#: ``(step, min, median, max)``
Spread = tuple[float, float, float, float]


class ScalarSpread:
    """The values each rank logged per name and step, the last ``history`` steps of each name;
    the spread of a step is worked out again at the next :meth:`series` after it changed."""

    def __init__(self, history: int) -> None:
        self._history = history
        self._at: dict[str, dict[float, dict[int, float]]] = {}  # name -> step -> rank -> value
        self._spread: dict[str, dict[float, Spread]] = {}
        self._series: dict[str, tuple[Spread, ...]] = {}
        #: name -> steps whose spread changed since the last :meth:`series`
        self._dirty: dict[str, set[float]] = {}

    def add(self, rank: int, name: str, x: float, v: float) -> None:
        """``rank`` logged ``v`` as ``name`` at step ``x``."""
        at = self._at.setdefault(name, {})
        col = at.get(x)
        if col is None:
            col = at[x] = {}
            if len(at) > self._history:
                oldest = min(at)
                del at[oldest]
                self._spread.get(name, {}).pop(oldest, None)
        col[rank] = v
        self._changed(name).add(x)

    def _changed(self, name: str) -> set[float]:
        steps = self._dirty.get(name)
        if steps is None:
            steps = self._dirty[name] = set()
        return steps

    def add_all(self, rank: int, logged: Iterable[tuple[str, float, float]]) -> None:
        """:meth:`add` for each ``(name, step, value)`` ``rank`` logged (inline: at 16,384
        ranks, sixteen thousand values a second)."""
        at_name, add = self._at, self.add
        for name, x, v in logged:
            at = at_name.get(name)
            col = at.get(x) if at is not None else None
            if col is None:
                add(rank, name, x, v)  # a new step: the window moves
            else:
                col[rank] = v
                self._changed(name).add(x)

    def add_columns(self, rank: int, name: str, xs: Sequence[float], vs: Sequence[float]
                    ) -> None:
        """:meth:`add` for the values ``vs`` ``rank`` logged as ``name`` at steps ``xs``."""
        at = self._at.get(name)
        if at is not None:
            try:  # as a rule, another rank logged these steps first: no new step, no window
                for x, v in zip(xs, vs):
                    at[x][rank] = v
                self._changed(name).update(xs)
                return
            except KeyError:  # a new step: the window moves (what was set is set again)
                pass
        for x, v in zip(xs, vs):
            self.add(rank, name, x, v)

    def series(self) -> dict[str, tuple[Spread, ...]]:
        """name -> ``(step, min, median, max)`` per step, oldest first."""
        changed = set()
        for name, xs in self._dirty.items():
            at = self._at[name]
            for x in xs:
                col = at.get(x)
                if col is not None:
                    vals = sorted(col.values())
                    self._spread.setdefault(name, {})[x] = (x, vals[0], statistics.median(vals),
                                                            vals[-1])
                    changed.add(name)
        self._dirty.clear()
        for name in changed:
            by_x = self._spread[name]
            self._series[name] = tuple(by_x[x] for x in sorted(by_x))
        return dict(self._series)


#: a rank's curve of one logged name: ``(step, value)`` points, oldest first
Curve = tuple[tuple[float, float], ...]


def scalar_curves(folds: Mapping[int, RankFold], former: Sequence[tuple[int, RankFold]]
                  ) -> dict[str, dict[int, Curve]]:
    """name -> rank -> its curve, from the ranks' ``folds`` (in rank order), made again only
    where the rank logged since (:attr:`.RankFold.scalar_curves` keeps them); a replacement's
    curve goes on from its predecessors' (``former``: ``(rank, fold)`` of the workers
    replacements took over from)."""
    curves: dict[str, dict[int, Curve]] = {}
    for r in sorted(folds):
        st = folds[r]
        for name, pts in st.scalar_points.items():
            curve = st.scalar_curves.get(name)
            if curve is None:
                before = [p for q, old in former if q == r
                          for p in old.scalar_points.get(name, ())]
                curve = st.scalar_curves[name] = tuple(before + pts)
            curves.setdefault(name, {})[r] = curve
    return curves
