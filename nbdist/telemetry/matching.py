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

When ranks' reports are matched: each step and each collective outside steps waits in a
:class:`StepMatcher` for every rank that may still report it, and is split by the rules above
once the last report arrives, or once the ranks it still waits for have ended. A StepMatcher
belongs to a run's fold (:class:`~.aggregate.RunState`), which hands it each rank's step reports
and collectives outside steps; it writes each match's split into the folds of the ranks that
took part (:class:`~.ranks.RankFold`) and keeps the run's per-step series and who was waited
for in each recent step.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import fsum
from typing import Any, NamedTuple, Optional

from .ranks import RankFold, Report, to_ns
from .snapshot import STRAGGLER_MIN_S, WINDOW, StepPoint

#: a difference in waiting below this (seconds) is timer noise: nobody is named for it
WAIT_NOISE_S = 1e-4
#: a rank is flagged as the straggler when the others spend at least this share of their step
#: waiting for it, on average over the recent steps, more than the median other rank costs,
#: and at least :data:`~.snapshot.STRAGGLER_MIN_S` seconds per step more (timer noise on tiny
#: steps is not a straggler)
STRAGGLER_SCORE = 0.05
#: steps every rank must have reported before anyone is flagged
STRAGGLER_MIN_STEPS = 5
#: collectives outside steps waiting for their peers' reports (older ones are dropped)
MAX_PENDING_COLLECTIVES = 10_000
#: ranks whose every step is matched; in a larger run one step in ``ranks // MATCHED_RANKS``
#: is (see :class:`StepMatcher`)
MATCHED_RANKS = 256


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


class Blame(NamedTuple):
    """Who the others waited for in one matched step (:func:`blame`)."""

    rank: int  # the rank the others waited for
    share: float  # the mean share of their step the others spent waiting for it, 0-1
    waiting_s: float  # the mean seconds the others spent waiting for it


def blame(m: MatchedStep) -> Optional[Blame]:
    """Who the others waited for in ``m``; None when nobody waited measurably (or nobody else
    reported)."""
    r = m.last
    others = [q for q in m.reports if q != r]
    if r is None or not others:
        return None
    waiting, reports = m.waiting, m.reports
    shares = [min(1.0, waiting[q] / reports[q][_STEP_S]) if reports[q][_STEP_S] > 0 else 0.0
              for q in others]  # waiting_share, inline: this runs for every rank and step
    return Blame(r, statistics.fmean(shares), statistics.fmean([waiting[q] for q in others]))


_ZERO = StragglerScore(0.0, 0.0, 0.0)


def scores_of(blames: Sequence[Optional[Blame]], ranks: Sequence[int]
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
        if b is None or b.rank not in out:
            continue
        r = b.rank
        last[r] = last.get(r, 0.0) + 1
        score[r] = score.get(r, 0.0) + b.share
        caused[r] = caused.get(r, 0.0) + b.waiting_s
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
    # each rank against the median of the others, from one sorted list per figure: a job of
    # thousands of ranks is judged in n log n, not n squared
    by_score = sorted(s.score for s in scores.values())
    by_caused = sorted(s.caused_s for s in scores.values())
    out = []
    for r, s in scores.items():
        if (s.score - _median_without(by_score, s.score) >= min_score
                and s.caused_s - _median_without(by_caused, s.caused_s) >= min_s):
            out.append(r)
    return sorted(out)


def _median_without(xs: Sequence[float], x: float) -> float:
    """The median of sorted ``xs`` with one ``x`` taken out (``statistics.median`` of the
    rest; ``xs`` holds ``x`` and one more value at least)."""
    i = bisect.bisect_left(xs, x)
    n = len(xs) - 1

    def at(k: int) -> float:  # the k-th of the rest
        return xs[k] if k < i else xs[k + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


# ----------------------------------------------------------------- when reports are matched
class StepMatcher:
    """Reports waiting for the rest of their ranks, and the matches made of them.

    Above :data:`MATCHED_RANKS` ranks, one step in ``ranks // MATCHED_RANKS`` (those whose
    number it divides, the same steps on every rank) is matched, and the others only count
    in each rank's own figures: matching costs the notebook a little per rank and step, and
    a sample of steps spread evenly through the run tells the same story of who waits for whom
    at a fixed cost per second (at 1,024 ranks, one step in 4; the per-step series then has
    a point every 4 steps).

    Parameters
    ----------
    ranks : dict of int to RankFold
        The fold's ranks, shared: a rank the fold adds is one a report may wait for.
    history : int
        Steps kept waiting, and points kept in :attr:`series`.
    """

    def __init__(self, ranks: Mapping[int, RankFold], history: int) -> None:
        self._ranks = ranks
        self._history = history
        #: ranks not finished: a step is matched once all of them reported (the fold counts
        #: a rank in when it adds it, and out when it ends)
        self.active = 0
        # step -> rank -> its report
        self._pending: dict[int, dict[int, Report]] = {}
        # (op, k) -> rank -> (seconds, bytes) of its k-th call of op outside steps
        self._free: dict[tuple[str, int], dict[int, tuple[float, int]]] = {}
        #: who was waited for in each of the last WINDOW matched steps (see :func:`.blame`)
        self.blames: deque[Optional[Blame]] = deque(maxlen=WINDOW)
        #: steps matched so far (a rank's ``m_index`` numbers its matches in this count)
        self.matched = 0
        #: step -> the point it adds to the run's per-step series, the last ``history``
        self.series: dict[int, StepPoint] = {}

    @property
    def every(self) -> int:
        """One step in this many is matched: the steps whose number it divides (0 or 1: every
        step)."""
        return len(self._ranks) // MATCHED_RANKS

    def steps(self, rank: int, ns: Sequence[int], reports: Sequence[Report]) -> None:
        """``rank``'s reports of steps ``ns`` (:meth:`.RankFold.add_steps`); each step is
        matched across ranks once its last report arrives (``ns`` may hold only the steps
        matched: see :attr:`every`)."""
        pending = self._pending
        every = self.every
        for n, report in zip(ns, reports):
            if every > 1 and n % every:
                continue  # not one of the steps matched in a run this large
            step = pending.get(n)
            if step is None:
                step = pending[n] = {}
            step[rank] = report
            while len(pending) > self._history:  # a rank stopped reporting: give up on it
                del pending[min(pending)]
            # Not given up already (a rank far behind, async), and maybe the last report
            # (fewer reports than ranks still running cannot be all of them).
            if len(step) >= self.active and n in pending:
                self._settle(n)

    def collective(self, rank: int, op: str, t0: float, t1: float, nbytes: int) -> None:
        """A collective ``rank`` called outside any step."""
        st = self._ranks[rank]
        # Collectives run in the same order on every rank of a group: the k-th call of an op
        # on one rank is the k-th call of that op on the others.
        k = st.free_seq.get(op, 0)
        st.free_seq[op] = k + 1
        if t1 <= t0:
            return  # untimed
        key = (op, k)
        self._free.setdefault(key, {})[rank] = (t1 - t0, nbytes)
        while len(self._free) > MAX_PENDING_COLLECTIVES:
            del self._free[next(iter(self._free))]
        self._settle_free(key)

    def settle_all(self) -> None:
        """Match what no longer waits for a rank that ended."""
        for step in sorted(self._pending):
            self._settle(step)
        for key in list(self._free):
            self._settle_free(key)

    def _waiting_on(self, reporters: Mapping[int, Any]) -> bool:
        """True while a rank that has not reported may still report (it has not ended)."""
        if len(reporters) < self.active:
            return True  # not every rank still running can be among them: no need to look
        if self.active == len(self._ranks):
            return False  # no rank has ended: as many reporters as ranks are all of them
        return any(st.state.active and r not in reporters for r, st in self._ranks.items())

    def _settle(self, step: int) -> None:
        reports = self._pending[step]
        if self._waiting_on(reports):
            return
        del self._pending[step]
        if None in reports.values():
            return  # a rank did not time this step's communication: nothing to split
        m = match_step(step, reports)
        self.blames.append(blame(m))
        index = self.matched
        self.matched += 1
        bws = []
        tt = m.transfer_time_s
        waiting, transfer = m.waiting, m.transfer_s
        for r, rep in reports.items():
            st = self._ranks[r]
            bw = rep[3] / tt if rep[3] and tt else None  # m.bandwidth(r), inline
            if bw is not None:
                bws.append(bw)
            st.m_index.append(index)
            st.m_waiting.append(waiting[r])
            st.m_transfer.append(transfer)
            st.m_bw.append(bw)
        reps = list(reports.values())
        k = len(reps)
        # fsum: the same whatever order the ranks' reports came in
        self.series[step] = StepPoint(
            step, fsum(p[0] for p in reps) / k, fsum(max(0.0, p[0] - p[1]) for p in reps) / k,
            fsum(waiting.values()) / k, transfer, sum(p[3] for p in reps) // k,
            statistics.median(bws) if bws else None, k, m.last)
        while len(self.series) > self._history:
            del self.series[min(self.series)]

    def _settle_free(self, key: tuple[str, int]) -> None:
        reports = self._free[key]
        if self._waiting_on(reports):
            return
        del self._free[key]
        m = MatchedCollective(key[0], {r: v[0] for r, v in reports.items()},
                              {r: v[1] for r, v in reports.items()})
        for r in reports:
            st = self._ranks[r]
            st.free += 1
            st.free_waiting_ns += to_ns(m.waiting(r))
            st.free_transfer_ns += to_ns(m.transfer_s)
            bw = m.bandwidth(r)
            if bw is not None:
                st.free_bw.append(bw)
