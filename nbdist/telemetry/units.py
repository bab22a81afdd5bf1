"""How numbers are written for people: rates, byte rates, durations. Shared by every view.

A leaf module (no nbdist imports), so the fold's records and all views may use it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional


def fmt_rate(x: Optional[float], unit: str = "") -> str:
    """``12.3 it/s`` style, shared by the text and widget views."""
    if x is None:
        return "-"
    for suffix, scale in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix} {unit}".rstrip()
    return f"{x:.3g} {unit}".rstrip()


def fmt_bytes_rate(x: Optional[float]) -> str:
    """Bytes per second with a decimal unit (``1.2 GB/s``)."""
    if x is None:
        return "-"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} B/s"


def fmt_seconds(x: Optional[float]) -> str:
    """A duration: µs and ms for short ones, ``m:ss`` and ``h:mm:ss`` past two minutes."""
    if x is None:
        return "-"
    if x == 0:
        return "0 ms"
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    if x < 1:
        return f"{x * 1e3:.3g} ms"
    if x < 120:
        return f"{x:.3g} s"
    m, s = divmod(int(x), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


def fmt_fraction(x: Optional[float]) -> str:
    """A share as a whole percentage (``37%``), ``-`` when unknown."""
    return f"{x:.0%}" if x is not None else "-"


def fmt_ranks(ranks: Iterable[int]) -> str:
    """Ranks as runs of ranges: ``[0, 1, 2, 5]`` → ``"0-2, 5"``.

    >>> fmt_ranks([5, 0, 2, 1])
    '0-2, 5'
    """
    out: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r != run[-1] + 1:
            out.append(_span(run))
            run = []
        run.append(r)
    if run:
        out.append(_span(run))
    return ", ".join(out)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def fmt_bytes(x: Optional[float]) -> str:
    """A size with a decimal unit (``12.3 MB``), ``-`` when unknown."""
    if x is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} B"


#: units a column may mix, by family, with their scale: a column is written in one of them
_FAMILIES = ({"µs": 1e-6, "ms": 1e-3, "s": 1.0}, {"B": 1.0, "kB": 1e3, "MB": 1e6, "GB": 1e9},
             {"B/s": 1.0, "kB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9})


def one_unit(cells: Sequence[str]) -> list[str]:
    """A column's cells in one unit, the one its largest value is written in, so that rows
    compare at a glance (``["68.2 ms", "850 µs"]`` → ``["68.2 ms", "0.85 ms"]``), a fraction
    of it to two decimals at most, so the cell is no wider than the largest. Cells
    that are not ``<number> <unit>`` of the column's family (``-``, ``Σ 1 s``, ``2:05``)
    stay as they are.

    >>> one_unit(["19 kB", "370 MB", "0 B", "-"])
    ['0.02 MB', '370 MB', '0 MB', '-']
    """
    parsed: list[Optional[tuple[float, str]]] = []
    for cell in cells:
        number, _, unit = cell.partition(" ")
        try:
            parsed.append((float(number), unit))
        except ValueError:
            parsed.append(None)
    units = {p[1] for p in parsed if p is not None}
    family = next((f for f in _FAMILIES if units and units <= f.keys()), None)
    if family is None or len(units) < 2:
        return list(cells)
    top = max((p for p in parsed if p is not None), key=lambda p: abs(p[0] * family[p[1]]))[1]

    def write(x: float, unit: str) -> str:  # as narrow as the largest: "0.32 ms", "<0.01 s"
        v = x * family[unit] / family[top]
        if v == 0 or abs(v) >= 1:
            return f"{v:.3g} {top}"
        return f"{v:.2f}".rstrip("0") + f" {top}" if abs(v) >= 5e-3 else f"<0.01 {top}"
    return [cell if p is None else write(*p) for cell, p in zip(cells, parsed)]
