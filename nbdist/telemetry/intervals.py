"""Interval arithmetic on ``(start, end)`` seconds: what the worker's step accounting and the
notebook's fold both need. A leaf module (stdlib only), so the worker never imports the fold.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from math import fsum
from typing import Optional


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as sorted, disjoint intervals (empty ones left out).

    The same union gives the same list however its intervals were grouped before, so parts
    merged apart (on a worker, in two batches) and merged again give what merging all at
    once gives.

    >>> merge([(5, 6), (0, 2), (1, 3), (4, 4)])
    [(0, 3), (5, 6)]
    """
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Total time covered by ``intervals`` (overlaps counted once).

    >>> union_seconds([(0, 2), (1, 3), (5, 6)])
    4.0
    """
    return float(fsum(b - a for a, b in merge(intervals)))


def exposed_seconds(compute_end: float, intervals: Iterable[tuple[float, float]]) -> float:
    """Communication left after compute ended: the part of ``intervals`` past ``compute_end``."""
    return union_seconds((max(a, compute_end), b) for a, b in intervals if b > compute_end)


def bandwidth(nbytes: int, intervals: Iterable[tuple[float, float]]) -> Optional[float]:
    """Algorithm bandwidth in bytes/s: payload over the time some collective was running."""
    busy = union_seconds(intervals)
    return nbytes / busy if busy > 0 and nbytes > 0 else None


def rate(points: Sequence[tuple[float, float]]) -> Optional[float]:
    """Units per second between the first and last ``(t, count)`` point."""
    if len(points) < 2:
        return None
    (t0, n0), (t1, n1) = points[0], points[-1]
    return (n1 - n0) / (t1 - t0) if t1 > t0 else None


def bubble_fraction(span_s: float, busy_s: float) -> float:
    """The idle share of a pipeline step of ``span_s`` seconds that computed ``busy_s``.

    >>> bubble_fraction(2.0, 1.5)
    0.25
    """
    return min(1.0, max(0.0, 1.0 - busy_s / span_s)) if span_s > 0 else 0.0
