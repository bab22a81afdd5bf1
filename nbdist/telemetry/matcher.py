"""When ranks' reports are matched: each step and each collective outside steps waits here for
every rank that may still report it, and is split (by the rules of :mod:`.matching`) once the
last report arrives, or once the ranks it still waits for have ended.

A :class:`StepMatcher` belongs to a run's fold (:class:`~.aggregate.RunState`), which hands it
each rank's step reports and collectives outside steps; it writes each match's split into
the folds of the ranks that took part (:class:`~.ranks.RankFold`) and keeps the run's
per-step series and who was waited for in each recent step. Pure, like the fold.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from math import fsum
from typing import Any, Optional

from .matching import MatchedCollective, blame, match_step
from .ranks import RankFold, Report, to_ns
from .snapshot import WINDOW, StepPoint

#: collectives outside steps waiting for their peers' reports (older ones are dropped)
MAX_PENDING_COLLECTIVES = 10_000


class StepMatcher:
    """Reports waiting for the rest of their ranks, and the matches made of them.

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
        self.blames: deque[Optional[tuple[int, float, float]]] = deque(maxlen=WINDOW)
        #: steps matched so far (a rank's ``m_index`` numbers its matches in this count)
        self.matched = 0
        #: step -> the point it adds to the run's per-step series, the last ``history``
        self.series: dict[int, StepPoint] = {}

    def steps(self, rank: int, ns: Sequence[int], reports: Sequence[Report]) -> None:
        """``rank``'s reports of steps ``ns`` (:meth:`.RankFold.add_steps`); each step is
        matched across ranks once its last report arrives."""
        pending = self._pending
        for n, report in zip(ns, reports):
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
