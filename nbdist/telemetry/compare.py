"""Runs side by side: the figures that tell training strategies apart. Pure numbers.

Each named run is summarised from its snapshot into one :class:`RunFigures`, with its
verdicts (:mod:`.verdicts`) judged against the other runs; the views (``display``) draw them
and ``records.Comparison`` turns them into a pandas DataFrame.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

from .snapshot import RunSnapshot
from .verdicts import NO_CONTEXT, Context, Tuned, reference, verdicts

# (attribute, column label, scale): the numeric columns, in order, with units in the label.
COLUMNS: tuple[tuple[str, str, float], ...] = (
    ("ranks", "ranks", 1),
    ("steps", "steps", 1),
    ("samples_per_s", "samples/s", 1),
    ("step_s", "step time (ms)", 1e3),
    ("exposed_fraction", "exposed comm (%)", 100),
    ("bubble", "bubble (%)", 100),
    ("bytes_per_step", "comm/step (MB)", 1e-6),
    ("params", "params/rank (MB)", 1e-6),
    ("grads", "grads/rank (MB)", 1e-6),
    ("optimizer", "optimizer/rank (MB)", 1e-6),
    ("peak_rss", "peak RSS (MB)", 1e-6),
)


@dataclass(frozen=True)
class RunFigures:
    """One run's figures: rates over all ranks, memory of the rank that holds the most."""

    name: str
    ranks: int
    steps: int
    samples_per_s: Optional[float]  # summed over ranks
    step_s: Optional[float]  # median over ranks of each rank's median step
    exposed_fraction: Optional[float]  # the worst rank's share of a step
    bytes_per_step: Optional[float]  # mean over ranks of a step's collective payload
    params: Optional[int]  # bytes, the largest over ranks
    grads: Optional[int]
    optimizer: Optional[int]
    peak_rss: Optional[int]
    scalars: dict[str, float] = field(default_factory=dict)
    bubble: Optional[float] = None  # a pipeline's mean idle fraction per stage
    #: what the numbers mean: (rule, sentence) of each verdict, at most three
    verdicts: tuple[tuple[str, str], ...] = ()

    def values(self) -> list[Optional[float]]:
        """The numeric columns of :data:`COLUMNS`, scaled to their labels' units."""
        out = []
        for attr, _label, scale in COLUMNS:
            v = getattr(self, attr)
            out.append(None if v is None else v * scale)
        return out


def _median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def _most(xs: list[Optional[int]]) -> Optional[int]:
    known = [x for x in xs if x is not None]
    return max(known) if known else None


def figures(name: str, snap: RunSnapshot, context: Context = NO_CONTEXT) -> RunFigures:
    """Summarise one run; its verdicts may compare it with ``context``'s runs."""
    ranks = snap.ranks
    samples = [r.samples_per_s for r in ranks if r.samples_per_s]
    mems = [r.memory for r in ranks if r.memory is not None]
    return RunFigures(
        name=name, ranks=len(ranks), steps=snap.steps,
        samples_per_s=sum(samples) if samples else None,
        step_s=_median([r.step_s for r in ranks if r.step_s is not None]),
        exposed_fraction=max((r.exposed_fraction for r in ranks
                              if r.exposed_fraction is not None), default=None),
        bytes_per_step=(statistics.fmean(b) if (b := [r.bytes_per_step for r in ranks
                                                       if r.bytes_per_step is not None])
                        else None),
        params=_most([m.params for m in mems]), grads=_most([m.grads for m in mems]),
        optimizer=_most([m.optimizer for m in mems]), peak_rss=_most([m.peak for m in mems]),
        scalars=dict(snap.scalars), bubble=snap.bubble,
        verdicts=tuple((v.rule, v.text) for v in verdicts(snap, context)))


def compare(runs: Mapping[str, RunSnapshot], tuned: tuple[Tuned, ...] = ()) -> list[RunFigures]:
    """Figures for each run, in the order given; each run's verdicts compare it with the
    others (and with what ``tuned`` says tuning found)."""
    refs = {name: reference(name, snap) for name, snap in runs.items()}
    return [figures(name, snap, Context(tuple(r for n, r in refs.items()
                                              if r is not None and n != name), tuned))
            for name, snap in runs.items()]
