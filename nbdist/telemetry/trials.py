"""A tuning trial's figures from its ranks' events: how fast the job moved once warm. Pure.

A trial is a cell cut after a fixed number of optimizer steps (``%%distributed --tune``).
Its first steps are not timed (DDP rebuilds its buckets after the first iteration, a static
graph and PowerSGD settle in their first ones); of the rest, each step counts as the job
moved: the slowest rank's step time, the samples of every rank. A setting tried in several
rounds pools its steps, and its figures are medians over them, robust to the odd step a
loaded machine stretches.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from .events import MEMORY, STEP, Event

__all__ = ["TrialFigures", "TrialSteps", "figures", "steps_of", "warmup"]


def warmup(steps: int) -> int:
    """Steps of a ``steps``-step trial left untimed: a fifth, at least 2."""
    return max(2, steps // 5)


@dataclass(frozen=True)
class TrialSteps:
    """One trial's timed steps, as the job moved (one value per step)."""

    step_s: tuple[float, ...]  # the slowest rank's step time
    samples: tuple[float, ...]  # samples of every rank together
    exposed: tuple[float, ...]  # share of the step the ranks' communication was exposed
    nbytes: tuple[int, ...]  # bytes the lowest rank sent in the step
    peak_memory: Optional[int]  # the largest GPU (else resident) memory peak of a rank


@dataclass(frozen=True)
class TrialFigures:
    """A setting's figures over the steps of its trials."""

    steps: int  # steps timed
    samples_per_s: Optional[float]  # median samples per step over median step time
    step_s: float  # median step time
    spread_s: float  # interquartile range of the step times
    exposed_fraction: Optional[float]  # median share of a step with exposed communication
    bytes_per_step: Optional[float]
    peak_memory: Optional[int]


def steps_of(events: Mapping[int, Sequence[Event]], skip: int) -> TrialSteps:
    """The steps of a trial's events (per rank, as ``Run.events()`` gives them), less the
    first ``skip``; only steps every rank reported count."""
    by_rank: dict[int, dict[int, Event]] = {}
    peaks: list[int] = []
    for rank, evs in events.items():
        steps = by_rank[rank] = {}
        last_memory: Optional[Event] = None
        for e in evs:
            if e["kind"] == STEP:
                steps[e["step"]] = e
            elif e["kind"] == MEMORY:
                last_memory = e
        if last_memory is not None:
            peak = last_memory.get("device_peak") or last_memory.get("peak")
            if peak:
                peaks.append(peak)
    common = sorted(set.intersection(*(set(s) for s in by_rank.values()))) if by_rank else []
    low = min(by_rank) if by_rank else 0
    step_s, samples, exposed, nbytes = [], [], [], []
    for n in common[skip:]:
        reports = [by_rank[r][n] for r in by_rank]
        lengths = [e["t1"] - e["t0"] for e in reports]
        step_s.append(max(lengths))
        samples.append(float(sum(e["samples"] for e in reports)))
        timed = [e["comm_exposed_s"] / length for e, length in zip(reports, lengths)
                 if e.get("comm_timed", True) and length > 0]
        if timed:
            exposed.append(min(1.0, statistics.fmean(timed)))
        nbytes.append(by_rank[low][n]["comm_bytes"])
    return TrialSteps(tuple(step_s), tuple(samples), tuple(exposed), tuple(nbytes),
                      max(peaks) if peaks else None)


def figures(parts: Iterable[TrialSteps]) -> Optional[TrialFigures]:
    """The figures of a setting's trials, their steps pooled (None: no step timed)."""
    parts = list(parts)
    step_s = [x for p in parts for x in p.step_s]
    if not step_s:
        return None
    samples = [x for p in parts for x in p.samples]
    exposed = [x for p in parts for x in p.exposed]
    nbytes = [x for p in parts for x in p.nbytes]
    peaks = [p.peak_memory for p in parts if p.peak_memory is not None]
    median = statistics.median(step_s)
    if len(step_s) >= 2:
        q1, _, q3 = statistics.quantiles(step_s, n=4)
        spread = q3 - q1
    else:
        spread = 0.0
    per_step = statistics.median(samples)
    return TrialFigures(
        steps=len(step_s), samples_per_s=per_step / median if per_step and median > 0 else None,
        step_s=median, spread_s=spread,
        exposed_fraction=statistics.median(exposed) if exposed else None,
        bytes_per_step=statistics.median(nbytes) if nbytes else None,
        peak_memory=max(peaks) if peaks else None)
