"""The hang doctor's verdict in words: the headline, one line per rank with its frames, and
the sentences an error carries (:mod:`.report` judges; this module only says)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from ..units import fmt_ranks, fmt_seconds
from .report import (
    DEBUGGING,
    ELSEWHERE,
    FAILED,
    FINISHED,
    GROUP_ABOVE,
    IN_COLLECTIVE,
    Collective,
    RankWhere,
    StallReport,
    Stranded,
)


def _at(line: Optional[int], label: Optional[str], script: Optional[str] = None) -> str:
    """``In [12], line 6``, ``cell line 6``, or a script's ``train.py:6``."""
    if line is None:
        return ""
    if script:
        return f"{script}:{line}"
    return f"{label}, line {line}" if label else f"cell line {line}"


def headline(v: StallReport) -> str:
    """One line: how long nothing moved, who waits in what, who never reached it; or, while
    ranks are in the debugger, that they are."""
    parts = []
    for c, ranks in v.waits:
        word = "ranks" if len(ranks) > 1 else "rank"
        parts.append(f"{word} {fmt_ranks(ranks)} wait{'' if len(ranks) > 1 else 's'} in "
                     f"{c.describe()}")
    if v.stopped:  # the run waits for the user, not a hang
        return "; ".join([s.describe() for s in v.stopped] + parts)
    head = f"no step or collective completed for {fmt_seconds(v.idle_s)}"
    if v.threshold_s is not None:
        head += f" (stall threshold {fmt_seconds(v.threshold_s)})"
    if v.missing:
        word = "ranks" if len(v.missing) > 1 else "rank"
        parts.append(f"{word} {fmt_ranks(v.missing)} never reached it")
    parts += [clash[:-1] for clash in clash_sentences(v)]
    if not v.waits:
        parts.append("no rank is inside a collective")
    return f"{head}: {'; '.join(parts)}"


def rank_line(w: RankWhere, label: Optional[str] = None,
              missing: Sequence[int] = (), waits: Sequence[Collective] = (),
              script: Optional[str] = None) -> str:
    """``rank 1: in time.sleep(0.05) at In [12], line 5 (never reached the all_reduce)``;
    ``script``: the file the ranks run (``at train.py:5``)."""
    at = _at(w.line, label, script)
    if w.status == IN_COLLECTIVE and w.collective is not None:
        text = f"rank {w.rank}: waiting in {w.collective.describe()}"
        if at:
            text += f" at {at}" + (f": {w.code}" if w.code else "")
        if w.doing and not (w.frames and w.frames[-1].cell):
            text += f" (in {w.doing})"
    elif w.status == ELSEWHERE:
        text = f"rank {w.rank}: in {w.doing or '?'}"
        inner_is_cell = bool(w.frames) and w.frames[-1].cell
        if at:
            text += f" at {at}"
            if w.code and not (inner_is_cell and w.code == w.doing):
                text += f": {w.code}"
    elif w.status == DEBUGGING:
        text = f"rank {w.rank}: {'in' if w.reason == 'pdb' else 'waiting for'} {w.doing}"
        if at:
            text += f" at {at}"
    elif w.status == FINISHED:
        text = f"rank {w.rank}: finished the cell"
    elif w.status == FAILED:
        text = f"rank {w.rank}: failed" + (f": {' '.join(w.error.split())}" if w.error else "")
    else:
        text = f"rank {w.rank}: no report of where it is"
    if w.rank in missing and waits:
        ops = sorted({c.op for c in waits})
        text += f"; it never reached the {' / '.join(ops)} the others wait in"
    return text


def where_lines(v: StallReport, label: Optional[str] = None,
                group_above: int = GROUP_ABOVE) -> list[str]:
    """A line per rank, then the cell's frames of any rank that is inside a function the
    cell defined (its call chain), indented under it.

    Above ``group_above`` ranks, ranks whose lines say the same are one line
    (``ranks 0-1022: waiting in all_reduce ...``), so a thousand ranks read in a few lines.
    """
    waits = [c for c, _ in v.waits]
    groups: dict[tuple[str, ...], list[int]] = {}
    for w in v.ranks:
        head = rank_line(w, label, v.missing, waits, v.script)
        lines = [head[len(f"rank {w.rank}: "):]]
        cell = [f for f in w.frames if f.cell]
        if len(cell) > 1:
            for f in cell:
                lines.append(f"    {_at(f.line, label, v.script)}, in {f.name}: "
                             f"{f.call or f.code}")
        key = tuple(lines) if len(v.ranks) > group_above else (str(w.rank), *lines)
        groups.setdefault(key, []).append(w.rank)
    out = []
    for key, ranks in groups.items():
        lines = key if len(v.ranks) > group_above else key[1:]
        word = "ranks" if len(ranks) > 1 else "rank"
        out += [f"{word} {fmt_ranks(ranks)}: {lines[0]}", *lines[1:]]
    return out


def clash_sentences(v: StallReport) -> list[str]:
    """``all_reduce and broadcast are both collective 5 of group default_pg: ...``."""
    return [f"{a.op} and {b.op} are both collective {a.seq} of group {a.group}: the ranks "
            "called different collectives." for a, b in v.clashes]


def missing_sentence(v: StallReport) -> str:
    """``Rank 1 never reached the all_reduce (seq 3) that rank 0 waits in.`` ("" if none)."""
    if not v.hang:
        return ""
    waited = "; ".join(f"{c.describe()} that rank{'s' if len(rs) > 1 else ''} "
                       f"{fmt_ranks(rs)} wait{'' if len(rs) > 1 else 's'} in"
                       for c, rs in v.waits)
    word = "Ranks" if len(v.missing) > 1 else "Rank"
    return f"{word} {fmt_ranks(v.missing)} never reached the {waited}."


def stranded_sentence(s: Stranded, label: Optional[str] = None) -> str:
    """``Rank 1 finished the cell while rank 0 waits in all_reduce (seq 13, float32 [5]) at
    In [3], line 10: loss.backward(), a collective of every rank that rank 1 will never
    call.``"""
    places = []
    for w in s.waiting:
        assert w.collective is not None  # waiting ranks wait in one
        at = _at(w.line, label, s.report.script)
        places.append(f"rank {w.rank} waits in {w.collective.describe()}"
                      + (f" at {at}" + (f": {w.code}" if w.code else "") if at else ""))
    word = "Ranks" if len(s.finished) > 1 else "Rank"
    who = fmt_ranks(s.finished)
    return (f"{word} {who} finished the cell while {'; and '.join(places)}: a collective of "
            f"every rank, which {word.lower()} {who} will never call.")
