"""The notebook's side of elastic training (``nbdist.elastic.run``) during one cell; the
workers' side is :mod:`nbdist.runtime.elastic`, and the store keys both use are spelled in its
:mod:`~nbdist.runtime.elastic.protocol`.

Workers report what happens to them as ``elastic`` events, and the :class:`Coordinator` is
their only reader (the run's record shows of elastic training what the coordinator records, no
more). It decides who is in the group next — the workers that reported the failure and are
still alive — and writes that membership as a plan into the rendezvous store, which the
notebook hosts. Where nbdist started the cluster it also brings in a replacement worker,
which joins the survivors at a commit and heals from one of them. The cell loop
(:mod:`nbdist.cell.loop`) feeds it batches (before the run's record folds them) and calls
:meth:`Coordinator.tick` while the cell runs; what happened is kept as records (a
:class:`~nbdist.telemetry.recovery.Lost` rank the moment it is found dead, a
:class:`~nbdist.telemetry.recovery.Recovery` per re-formed group, replacement or stop) that the
cell loop hands to the run's record.

The Coordinator works on the job's :class:`~nbdist.group.membership.Membership` in place: each
plan it writes is the job's membership from then on (its plans and generation), and a replacement
worker enters through :meth:`Membership.admit`, as every worker does.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

from ..backends.base import Call, Submission, WorkerId
from ..group.losses import live_workers, lost_worker, oom_kills
from ..runtime import worker as rt
from ..runtime.elastic.protocol import Plan, join_key, plan_key
from ..runtime.env import RankPlan
from ..runtime.measure.spec import Measure
from ..telemetry.events import ELASTIC, Batch, ElasticWhat
from ..telemetry.recovery import Lost, Recovery, RecoveryKind

if TYPE_CHECKING:
    from ..backends.base import Backend
    from ..boot.store_host import StoreHost
    from ..group.membership import Membership

#: how long a member may take to report a failure the others saw before it counts as gone
REPORT_DEADLINE = 60.0
#: the default failure budget of an elastic run
DEFAULT_MAX_FAILURES = 3
#: seconds without the replacement asked for before the engine is asked once more
REPLACEMENT_RETRY_S = 10.0


@dataclass
class _Run:
    """One elastic run (one ``elastic.run`` call across the ranks)."""

    key: str
    members: list[WorkerId]
    slots: dict[WorkerId, int]
    target: int
    #: the budget when the run's own ``max_failures`` is not given (the profile's, or 3)
    default_max_failures: int = DEFAULT_MAX_FAILURES
    epoch: int = 0
    generation: Optional[int] = None
    failures: int = 0
    max_failures: Optional[int] = None
    failed: dict[WorkerId, dict] = field(default_factory=dict)  # reports since the last plan
    first_report: Optional[float] = None
    stopped: dict[WorkerId, str] = field(default_factory=dict)
    joiner: Optional[WorkerId] = None  # a replacement waiting to join
    replacing: Optional[float] = None  # when a replacement was asked for
    replace_slot: Optional[int] = None  # the lost rank's slot the replacement takes
    asked_again: bool = False  # the engine was asked a second time (none came up at first)
    asked: dict[WorkerId, float] = field(default_factory=dict)  # replacement -> asked at
    joined: set = field(default_factory=set)  # replacements that healed
    open_recovery: Optional[Recovery] = None
    ended: bool = False

    @property
    def budget(self) -> int:
        """How many failures this run survives (``max_failures``)."""
        return self.max_failures if self.max_failures is not None else self.default_max_failures


class Coordinator:
    """Coordinates the elastic runs of one cell; see the module docstring."""

    def __init__(self, membership: Membership, measure: Measure, *,
                 default_max_failures: Optional[int]) -> None:
        self.membership = membership
        #: the cell's telemetry switches, which a replacement worker's run of it takes too
        self.measure = measure
        self.default_max_failures = (DEFAULT_MAX_FAILURES if default_max_failures is None
                                     else default_max_failures)
        self.job: Optional[Submission] = None  # the cell's job; see follow()
        plans = membership.plans
        self.target = len(plans)  # the size a replacement restores
        self.by_name = {str(p.worker_id): p.worker_id for p in plans}
        self.runs: dict[str, _Run] = {}
        #: what happened, in order: each rank found dead, each recovery (see news())
        self.records: list[Union[Lost, Recovery]] = []
        self.joiner_jobs: list[tuple[WorkerId, Submission]] = []
        self.slots = {p.worker_id: p.rank for p in plans}  # worker -> telemetry slot
        self._printed = 0
        self._known = {p.worker_id for p in plans}  # the engine's workers we have seen
        self.seq_base = 1_000_000
        self._oom = oom_kills()  # the baseline: kills counted before the cell
        #: the workers found dead, and their records: the cell loop records no second death
        #: for them, and their ranks' errors say it as the records do
        self.found_lost: dict[WorkerId, Lost] = {}

    @property
    def coordinating(self) -> bool:
        """An elastic run of the cell has begun: what the next events say may change the job
        (a cell that never calls ``nbdist.elastic.run`` leaves it False)."""
        return bool(self.runs)

    @property
    def backend(self) -> Backend:
        return self.membership.require()

    @property
    def store(self) -> StoreHost:
        assert self.membership.store is not None  # elastic cells need the notebook's store
        return self.membership.store

    @property
    def timeout(self) -> float:
        return self.membership.options.timeout

    def follow(self, job: Submission) -> None:
        """Coordinate the cell running as ``job`` (replacement workers' jobs join
        :attr:`joiner_jobs`)."""
        self.job = job

    # ------------------------------------------------------------------ events
    def feed(self, batches: list[Batch]) -> None:
        for b in batches:
            for ev in b.get("events", ()):
                if ev.get("kind") == ELASTIC:
                    self._event(ev)

    def _event(self, ev: dict) -> None:
        w = self.by_name.get(ev.get("worker"))
        if w is None:
            return
        key = ev["run"]
        r = self.runs.get(key)
        what = ElasticWhat(ev["what"])
        if r is None:  # a run starts from the job as it is now
            r = self.runs[key] = _Run(key, [p.worker_id for p in self.membership.plans],
                                      dict(self.slots), self.target, self.default_max_failures)
        if what is ElasticWhat.BEGIN and ev.get("max_failures") is not None:
            r.max_failures = ev["max_failures"]
        elif what is ElasticWhat.FAILED:
            r.failed[w] = ev
            r.first_report = r.first_report or time.monotonic()
            if r.open_recovery is None:
                r.open_recovery = Recovery(t=ev["t"], kind=RecoveryKind.FAILURE,
                                           world_before=ev.get("world") or len(r.members))
        elif what is ElasticWhat.STOPPED:
            r.stopped[w] = ev.get("error") or "an error"
        elif what is ElasticWhat.HEALED:
            joined = self.by_name.get(ev["joined"]) if ev.get("joined") is not None else None
            if joined is not None:
                if w == joined and joined not in r.joined:
                    r.joined.add(joined)
                    # the replacement reports as the lost rank's slot from now on, its steps
                    # counted from the job's step it joined at
                    step = ev.get("step")
                    self.records.append(Recovery(
                        t=ev["t"], kind=RecoveryKind.JOINED, commit=ev.get("commit"),
                        seconds=self._since(r.asked.get(joined), ev),
                        world_before=ev.get("world_before") or 0,
                        world_after=ev.get("world") or 0, rank=self.slots.get(joined),
                        step=None if step is None else int(step)))
                if r.joiner == joined:
                    r.joiner, r.replacing = None, None
            elif r.open_recovery is not None:
                rec = r.open_recovery
                rec.commit = ev.get("commit")
                rec.discarded = max(rec.discarded, int(ev.get("discarded") or 0))
                rec.seconds = max(rec.seconds or 0.0, float(ev.get("seconds") or 0.0))
                rec.world_after = ev.get("world") or rec.world_after
                if rec not in self.records:
                    self.records.append(rec)
                if w == r.members[0]:  # every member reports; the first closes the record
                    r.open_recovery = None

    @staticmethod
    def _since(start: Optional[float], ev: dict) -> Optional[float]:
        if start is None:
            return ev.get("seconds")
        return max(0.0, ev["t"] - start)

    # ------------------------------------------------------------------ decisions
    def tick(self) -> None:
        """Decide what the notebook can decide now; cheap when nothing happened."""
        for r in list(self.runs.values()):
            if r.ended:
                continue
            if r.failed or r.stopped:
                self._decide(r)
            elif r.joiner is not None and self._join_job(r.joiner).wait(0):
                if self._join_failed(r.joiner):
                    self._joiner_ended(r)
                else:  # it joined and finished; its report is on its way
                    r.joiner, r.replacing = None, None
            if r.joiner is None and r.replacing is not None:
                self._admit(r)

    def _alive(self) -> set[WorkerId]:
        return live_workers(self.membership, self.slots)

    def _decide(self, r: _Run) -> None:
        """Some member of ``r`` reported a failure (or its own error): write the next plan.

        Wait while a member is alive, still running and silent (it is about to report; its
        failure report says it is ready to re-form), up to :data:`REPORT_DEADLINE`. Then keep
        the live members that reported (and a replacement joining), and stop the run when one
        stopped it with its own error, the budget is spent, or nobody is left; otherwise
        re-plan the membership with them, write the plan, and ask for a replacement when the
        cluster is nbdist's and the run is smaller than it started.
        """
        assert self.job is not None
        live = self._alive()
        pending = set(self.job.pending()) | {w for w, j in self.joiner_jobs if not j.wait(0)}
        undecided = [w for w in r.members if w in live and w not in r.failed
                     and w not in r.stopped and w != r.joiner and w in pending]
        late = (r.first_report is not None
                and time.monotonic() - r.first_report > REPORT_DEADLINE)
        if undecided and not r.stopped and not late:
            return
        if r.joiner is not None and r.joiner not in pending:
            r.joiner, r.replacing = None, None  # its join call ended: it is not coming
        keep = [w for w in r.members if w in live and (w in r.failed or w == r.joiner)]
        lost = [w for w in r.members if w not in keep and w not in r.stopped]
        r.failures += 1
        abort, stopped_by = None, None
        if r.stopped:
            w, why = next(iter(r.stopped.items()))
            stopped_by = r.slots.get(w)
            abort = (f"rank {r.slots.get(w, '?')} stopped the elastic run with its own error "
                     f"({why}); elastic training recovers from lost ranks and failed "
                     "collectives, not from errors in the code")
        elif r.failures > r.budget:
            abort = (f"{r.failures} failures, over this run's budget "
                     f"(max_failures={r.budget}); look at why ranks fail before raising it")
        elif not keep:
            abort = "no rank is left to continue"
        rec = r.open_recovery or Recovery(t=time.time(), kind=RecoveryKind.FAILURE,
                                          world_before=len(r.members))
        r.open_recovery = rec
        epoch = r.epoch + 1
        if abort is not None:
            rec.lost = [self._lost(r, w) for w in lost]
            self.records += rec.lost
            self._write(r, Plan(epoch=epoch, generation=-1, abort=abort, failures=r.failures,
                                stopped_by=stopped_by))
            rec.kind, rec.why = RecoveryKind.STOPPED, abort
            if rec not in self.records:
                self.records.append(rec)
            r.ended = True
            return
        plans = self.membership.replan(keep)
        gen = self.membership.invalidate()
        want_more = (self.backend.owns_cluster and len(keep) < r.target
                     and r.joiner is None)
        joiner = r.joiner if r.joiner in keep else None
        plan = Plan(epoch=epoch, generation=gen,
                    ranks={str(p.worker_id): p for p in plans}, failures=r.failures,
                    join_expected=want_more or joiner is not None and len(keep) < r.target,
                    joiner=str(joiner) if joiner is not None else None,
                    joiner_slot=r.slots.get(joiner) if joiner is not None else None)
        rec.world_after = len(keep)
        self._write(r, plan)
        # After the plan is out: the survivors re-form while the engine is asked how it died.
        rec.lost = [self._lost(r, w) for w in lost]
        self.records += rec.lost  # news now: the recovery's own record follows once healed
        r.members = [p.worker_id for p in plans]
        r.generation = gen
        r.failed, r.first_report = {}, None
        r.open_recovery = rec
        if want_more:
            self._replace(r, lost)

    def _lost(self, r: _Run, w: WorkerId) -> Lost:
        lost = self.found_lost[w] = lost_worker(self.membership, w, r.slots.get(w), self._oom)
        return lost

    def _write(self, r: _Run, plan: Plan) -> None:
        self.store.set(plan_key(r.key, plan.epoch), pickle.dumps(plan))
        r.epoch = plan.epoch

    # ------------------------------------------------------------------ replacements
    def _replace(self, r: _Run, lost: list[WorkerId]) -> None:
        """Ask the engine for a worker to take a lost rank's slot."""
        r.replacing, r.asked_again = time.time(), False
        r.replace_slot = r.slots.get(lost[0]) if lost else None
        try:
            self.backend.add_worker(self._known)
        except Exception as exc:  # no replacement: the run carries on at the smaller size
            self._give_up_join(r, f"could not start a replacement worker: {exc}")

    def _give_up_join(self, r: _Run, why: str) -> None:
        r.replacing = None
        self.store.set(join_key(r.key), b"-1")
        self.records.append(Recovery(t=time.time(), kind=RecoveryKind.STOPPED, why=why))

    def _admit(self, r: _Run) -> None:
        """A new worker is up: make it the next member and let the survivors take it in."""
        try:
            live = set(self.backend.worker_ids())
        except Exception:
            return
        fresh = sorted((w for w in live if w not in self._known), key=str)
        if not fresh:
            waited = time.time() - (r.replacing or time.time())
            if waited > REPLACEMENT_RETRY_S and not r.asked_again:
                # The engine may have lost the replacement it was starting (a Dask nanny
                # closed while it restarted its worker): ask once more.
                r.asked_again = True
                try:
                    self.backend.add_worker(self._known)
                except Exception:  # no replacement: the time limit below ends the wait
                    pass
            if waited > self.timeout:
                self._give_up_join(r, "no replacement worker came up within "
                                      f"{self.timeout:g} s; the run carries on smaller")
            return
        w = fresh[0]
        self._known.add(w)
        try:
            self.membership.admit([w])
        except Exception:  # it went away as it came up (e.g. a worker restarted again): wait
            return  # for the next one, within the same time limit
        self.by_name[str(w)] = w
        slot = r.replace_slot
        if slot is None:
            slot = max(r.slots.values(), default=-1) + 1
        r.slots[w] = slot
        self.slots[w] = slot
        members = r.members + [w]
        plans = self.membership.replan(members)
        gen = self.membership.invalidate()
        plan = Plan(epoch=r.epoch + 1, generation=gen, ranks={str(p.worker_id): p for p in plans},
                    failures=r.failures, join_expected=len(members) < r.target,
                    joiner=str(w), joiner_slot=slot)
        self._write(r, plan)
        r.members = [p.worker_id for p in plans]
        r.generation = gen
        r.joiner = w
        r.asked[w] = r.replacing or time.time()
        self.seq_base += 1_000_000
        mine = next(p for p in plans if p.worker_id == w)
        self.joiner_jobs.append((w, self.membership.submit([self._join_call(mine, plan, r.key,
                                                                            slot)])))
        self.store.set(join_key(r.key), str(plan.epoch).encode())

    def _join_call(self, mine: RankPlan, plan: Plan, key: str, slot: int) -> Call:
        """The replacement's call: take ``mine`` without forming a group, join the members
        at ``plan``, heal, then run the rest of the cell with the cell's telemetry."""
        m, o = self.membership, self.membership.options
        return Call(mine.worker_id, rt.elastic_join,
                    (mine, m.port, o.device, m.dist_backend, o.timeout, plan, key, slot,
                     self.seq_base, False), {"measure": self.measure})

    def _join_job(self, w: WorkerId) -> Submission:
        return next(j for x, j in self.joiner_jobs if x == w)

    def _join_failed(self, w: WorkerId) -> bool:
        try:
            [o] = self._join_job(w).outcomes()
        except Exception:
            return True
        return (o.engine_error is not None or not o.value["ok"]
                or bool(o.value.get("not_joined")))

    def _joiner_ended(self, r: _Run) -> None:
        """A replacement's join call ended before it healed (it failed): the members go on
        without it, through a newer plan (those waiting for it follow that plan)."""
        w = r.joiner
        why = "it ended"
        try:
            [o] = self._join_job(w).outcomes()
            if o.engine_error is not None:
                why = o.engine_error.splitlines()[0]
            elif not o.value["ok"] and o.value["error"]:
                why = f"{o.value['error']['ename']}: {o.value['error']['evalue']}"
        except Exception:  # the reason is a detail; going on without it is what matters
            pass
        r.joiner, r.replacing = None, None
        r.failures += 1
        self.records.append(Recovery(t=time.time(), kind=RecoveryKind.STOPPED,
                                     why=f"a replacement worker failed to join ({why})"))
        members = [m for m in r.members if m != w]
        plans = self.membership.replan(members)
        again = self.backend.owns_cluster and r.failures <= r.budget
        plan = Plan(epoch=r.epoch + 1, generation=self.membership.invalidate(),
                    ranks={str(p.worker_id): p for p in plans}, failures=r.failures,
                    join_expected=again)
        self._write(r, plan)
        r.members = [p.worker_id for p in plans]
        r.generation = plan.generation
        if again:
            self._replace(r, [w])

    # ------------------------------------------------------------------ the end
    def wrap_up(self) -> None:
        """The survivors' calls returned: a replacement still waiting will not be let in."""
        for r in self.runs.values():
            if r.joiner is not None and not r.ended:
                self._write(r, Plan(epoch=r.epoch + 1, generation=-1,
                                    abort="the run finished before the replacement joined"))
                self.store.set(join_key(r.key), b"-1")
                r.members = [m for m in r.members if m != r.joiner]
                self.membership.replan(r.members)  # the group the members still have
                r.joiner = None
                r.ended = True

    def wrap_up_needed(self, pending: list[WorkerId]) -> bool:
        """True when only replacements waiting to join are still running: the members
        finished, and nobody will let them in."""
        waiting = {r.joiner for r in self.runs.values() if r.joiner is not None and not r.ended}
        return bool(waiting) and set(pending) <= waiting

    def final(self) -> Optional[_Run]:
        """The last elastic run that re-formed the group, if any."""
        changed = [r for r in self.runs.values() if r.generation is not None]
        return changed[-1] if changed else None

    def news(self) -> list[Union[Lost, Recovery]]:
        """What was recorded since the last call, in order."""
        new = self.records[self._printed:]
        self._printed = len(self.records)
        return new

    def new_lines(self) -> list[str]:
        return [r.line() for r in self.news()]
