"""Match what every rank reported about the same step or collective, and split the time each
rank spent communicating into *waiting* for the last rank to arrive and *transfer*.

Pure and clock-free: only durations measured on one rank's clock are compared, never
timestamps of two hosts, so clock skew between hosts cannot move a number.

A collective ends on every rank at about the same moment, so the rank that arrived last spends
the least time in it, and the others spent their extra time waiting for it (the split Horovod's
timeline draws between negotiation and the all-reduce itself):

* **transfer** of a collective is the time the last rank to arrive spends in it: the least time
  any rank spent in it;
* **waiting** of a rank is the rest of its time in it.

For a training step the same rule is applied to the step's *exposed* communication (what
compute did not hide, reported by each rank): the rank with the least exposed time is the one
the others waited for, its exposed time is the step's exposed transfer, and every other rank's
extra exposed time is waiting. Bandwidth uses the step's whole transfer time instead, the time
the rank that waited least spent in the step's collectives (overlaps counted once), because
collectives that compute hid still moved their bytes.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional

#: a difference in waiting below this (seconds) is timer noise: nobody is named for it
WAIT_NOISE_S = 1e-4
#: a rank is flagged as the straggler when the others spend at least this share of their step
#: waiting for it, on average over the recent steps, more than the median other rank costs ...
STRAGGLER_SCORE = 0.05
#: ... and at least this many seconds per step more (timer noise on tiny steps is not a
#: straggler)
STRAGGLER_MIN_S = 0.001
#: steps every rank must have reported before anyone is flagged
STRAGGLER_MIN_STEPS = 5


class RankStep(NamedTuple):
    """One rank's report of one step (a tuple: the fold makes one per rank and step)."""

    step_s: float
    exposed_s: float  # communication compute did not hide (waiting + transfer)
    busy_s: float  # time any of its timed collectives in the step was running
    nbytes: int  # bytes of those timed collectives
    #: False when a collective of the step has no time (a GPU bucket whose events had not
    #: completed when the step closed): its exposed time is then too short to compare
    timed: bool = True

    @property
    def compute_s(self) -> float:
        return max(0.0, self.step_s - self.exposed_s)


@dataclass(frozen=True)
class MatchedStep:
    """One step as every rank that ran it reported it, with the waiting/transfer split.

    ``reports`` are :class:`RankStep` tuples, or plain tuples of its fields in its order
    (what the fold keeps while a step waits for its last report).
    """

    step: int
    reports: Mapping[int, RankStep]
    waiting: Mapping[int, float]  # rank -> exposed seconds spent waiting for ``last``
    transfer_s: float  # exposed transfer: the exposed time of the last rank to arrive
    last: Optional[int]  # the rank the others waited for (None: nobody waited measurably)
    transfer_time_s: Optional[float]  # the step's whole transfer time, for bandwidth

    def bandwidth(self, rank: int) -> Optional[float]:
        """``rank``'s bytes in this step over the step's transfer time (bytes/s)."""
        rep = self.reports.get(rank)
        if rep is None or not rep[_NBYTES] or not self.transfer_time_s:
            return None
        return rep[_NBYTES] / self.transfer_time_s

    def waiting_share(self, rank: int) -> float:
        """The share of ``rank``'s step it spent waiting."""
        step_s = self.reports[rank][_STEP_S]
        return min(1.0, self.waiting[rank] / step_s) if step_s > 0 else 0.0


# RankStep's fields by position: the fold hands match_step plain tuples
_STEP_S, _EXPOSED, _BUSY, _NBYTES, _TIMED = range(5)


def match_step(step: int, reports: Mapping[int, RankStep]) -> MatchedStep:
    """Split step ``step``'s exposed communication on every rank that reported it."""
    timed = [r for r, rep in reports.items() if rep[_TIMED]] or list(reports)
    transfer, last = min((reports[r][_EXPOSED], r) for r in timed)
    waiting = {r: w if (w := rep[_EXPOSED] - transfer) > 0.0 else 0.0  # max(0, w), inline
               for r, rep in reports.items()}
    if max(waiting.values()) < WAIT_NOISE_S:
        waited_for: Optional[int] = None
    else:
        waited_for = last
    busy = [rep[_BUSY] for rep in reports.values() if rep[_BUSY] > 0]
    return MatchedStep(step, dict(reports), waiting, transfer, waited_for,
                       min(busy) if busy else None)


@dataclass(frozen=True)
class MatchedCollective:
    """One collective called outside any step, matched across ranks by its order."""

    op: str
    seconds: Mapping[int, float]  # rank -> time it spent in the call
    nbytes: Mapping[int, int]

    @property
    def transfer_s(self) -> float:
        return min(self.seconds.values())

    def waiting(self, rank: int) -> float:
        return self.seconds[rank] - self.transfer_s

    def bandwidth(self, rank: int) -> Optional[float]:
        t = self.transfer_s
        return self.nbytes[rank] / t if t > 0 and self.nbytes.get(rank) else None


@dataclass(frozen=True)
class StragglerScore:
    """How much the others wait for one rank, over the recent matched steps."""

    score: float  # mean share of the others' step spent waiting for this rank, 0-1
    caused_s: float  # mean seconds per step the others wait for this rank
    last_share: float  # share of the steps in which this rank arrived last


def blame(m: MatchedStep) -> Optional[tuple[int, float, float]]:
    """Who the others waited for in ``m``: ``(rank, mean share of their step spent waiting,
    mean seconds waiting)``; None when nobody waited measurably (or nobody else reported)."""
    r = m.last
    others = [q for q in m.reports if q != r]
    if r is None or not others:
        return None
    waiting, reports = m.waiting, m.reports
    shares = [min(1.0, waiting[q] / reports[q][_STEP_S]) if reports[q][_STEP_S] > 0 else 0.0
              for q in others]  # waiting_share, inline: this runs for every rank and step
    return (r, statistics.fmean(shares), statistics.fmean([waiting[q] for q in others]))


_ZERO = StragglerScore(0.0, 0.0, 0.0)


def scores_of(blames: Sequence[Optional[tuple[int, float, float]]], ranks: Sequence[int]
              ) -> dict[int, StragglerScore]:
    """:func:`straggler_scores` from the :func:`blame` of each step (the fold keeps those,
    so a snapshot does not go over every rank of every recent step again)."""
    n = len(blames)
    out = dict.fromkeys(ranks, _ZERO)
    if not n:
        return out
    score: dict[int, float] = {}
    caused: dict[int, float] = {}
    last: dict[int, float] = {}
    for b in blames:  # summed in step order, as straggler_scores always did
        if b is None or b[0] not in out:
            continue
        r = b[0]
        last[r] = last.get(r, 0.0) + 1
        score[r] = score.get(r, 0.0) + b[1]
        caused[r] = caused.get(r, 0.0) + b[2]
    for r in last:
        out[r] = StragglerScore(score[r] / n, caused[r] / n, last[r] / n)
    return out


def straggler_scores(steps: Sequence[MatchedStep], ranks: Sequence[int]
                     ) -> dict[int, StragglerScore]:
    """Score every rank by how long the others waited for it over ``steps``.

    In a step where rank ``r`` arrived last, ``r`` scores the mean share of their step that the
    other ranks spent waiting; in other steps it scores 0. The score is the mean over ``steps``:
    0 for a rank nobody waits for, 0.25 when the others lose a quarter of every step to it.
    """
    return scores_of([blame(m) for m in steps], ranks)


def flagged(scores: Mapping[int, StragglerScore], steps: int, *,
            min_score: float = STRAGGLER_SCORE, min_s: float = STRAGGLER_MIN_S,
            min_steps: int = STRAGGLER_MIN_STEPS) -> list[int]:
    """The ranks whose scores make them stragglers (``steps``: matched steps scored).

    A rank is measured against the median of the other ranks' scores, not against zero: where
    a busy machine takes the CPU from one rank and then another, every rank is waited for in
    turn and each scores about the same. That is noise, not a rank the others keep waiting for
    (in a 2-rank job both would otherwise be named); a rank the others wait for more than they
    wait for the rest is.
    """
    if steps < min_steps or len(scores) < 2:
        return []
    out = []
    for r, s in scores.items():
        others = [q for p, q in scores.items() if p != r]
        if (s.score - statistics.median(q.score for q in others) >= min_score
                and s.caused_s - statistics.median(q.caused_s for q in others) >= min_s):
            out.append(r)
    return sorted(out)
