"""Who is in the job: the workers, their rank plans, the rendezvous store and the group's
generation, and the one way nbdist's own calls reach them.

The :class:`~nbdist.session.Session` forms the job through :meth:`Membership.form`; during an
elastic cell the :class:`~nbdist.elastic.coordinator.Coordinator` re-plans the same object in place
(who is left, who joins), as torch elastic's agent works on its ``WorkerGroup``. Nothing copies
the membership back: there is one, and ``generation`` changes only in
:meth:`Membership.invalidate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Callable, Optional

from ..backends.base import Backend, Call, Submission, WorkerGone, WorkerId
from ..boot.store_host import StoreHost
from ..errors import ClusterError, NoClusterError, WorkerCallFailed, WorkersGone
from ..options import ClusterOptions
from ..records import ClusterStatus, WorkerRow
from ..runtime import results
from ..runtime import worker as rt
from ..runtime.env import LOOPBACK, RankPlan, choose_dist_backend, plan_ranks, store_addr
from ..runtime.results import Joined, WorkerInfo
from ..telemetry.recovery import Lost


class Membership:
    """The job's workers and how they are joined; see the module docstring.

    ``stores`` starts the notebook-side rendezvous store for a host (None: rank 0's worker
    hosts it, and elastic recovery is off).
    """

    def __init__(self, stores: Optional[Callable[[str, float], StoreHost]] = StoreHost) -> None:
        self.stores = stores
        self.backend: Optional[Backend] = None
        self.options = ClusterOptions()
        #: one per rank, in rank order
        self.plans: list[RankPlan] = []
        #: every worker's ``describe()`` record, by worker id
        self.infos: dict[WorkerId, WorkerInfo] = {}
        #: bumped whenever the process group must be formed again before the next full cell
        #: (workers compare it with the one their group was formed at)
        self.generation = 0
        #: the job store's port, and the notebook's store process (None: rank 0 hosts it)
        self.port: Optional[int] = None
        self.store: Optional[StoreHost] = None
        #: where the notebook's store listens when every worker reaches it (``MASTER_ADDR``)
        self.master: Optional[str] = None
        #: workers whose last call the engine failed: checked before the next job
        self.suspect: set[WorkerId] = set()
        #: what each rank said when it joined the group, by rank
        self.joined: dict[int, Joined] = {}
        #: the group's backend as asked, or gloo where ``auto`` ranks share a GPU
        self.dist_backend = "auto"
        #: a line for the user about how the group was formed ("" when nothing to say)
        self.note = ""
        #: how each worker lost since the job formed died (``status`` says it in its row)
        self.deaths: dict[WorkerId, Lost] = {}

    @property
    def world_size(self) -> int:
        """Ranks in the job (0 when none runs)."""
        return len(self.plans)

    def require(self) -> Backend:
        """The job's backend.

        Raises
        ------
        NoClusterError
            No job is running.
        """
        if self.backend is None:
            raise NoClusterError()
        return self.backend

    # ----------------------------------------------------------------- the store
    def warm_store(self, timeout: float) -> None:
        """Start the store on loopback now, while the engine starts workers on this host (it
        imports torch); :meth:`form` keeps it if every worker reaches it there. ``timeout``
        is the store's, in seconds."""
        if self.stores is not None:
            self.store = self.stores(LOOPBACK, timeout)

    def warming_store(self, progress: Optional[Callable[[int, int], None]], timeout: float
                      ) -> Callable[[int, int], None]:
        """``progress`` (a start's "k of n ready"), starting the store at its first call:
        where the store forks from the workers' template, that is when the template has forked
        them, and it starts while they register instead of after."""

        def first_warm(k: int, n: int) -> None:
            if self.store is None:
                self.warm_store(timeout)
            if progress is not None:
                progress(k, n)

        return first_warm

    def open_store(self, purpose: str, what: str) -> int:
        """Another store beside the job's (``what``: whose, for errors), on the notebook's
        store process or on rank 0's worker; returns its port.

        Raises
        ------
        StoreError
            The notebook's store process failed or did not answer (a ``RuntimeError``).
        ClusterError
            Rank 0's worker is gone, or did not open it within the job's ``timeout`` seconds
            (``WorkersGone``, ``WorkerCallFailed``).
        """
        if self.store is not None:
            return self.store.open(purpose)
        rank0, timeout = self.plans[0], self.options.timeout
        [port] = self.call([Call(rank0.worker_id, rt.open_store,
                                 (rank0.master_addr, purpose, timeout))],
                           timeout, f"open {what}")
        return port

    def close_store(self, purpose: str) -> None:
        """Close the store :meth:`open_store` opened for ``purpose``.

        Raises
        ------
        StoreError, ClusterError
            As for :meth:`open_store` (rank 0's worker has 30 seconds to answer).
        """
        if self.store is not None:
            self.store.close_store(purpose)
        else:
            self.call([Call(self.plans[0].worker_id, rt.close_store, (purpose,))], 30,
                      "close store")

    def _store_addr(self, infos: list[WorkerInfo]) -> Optional[str]:
        """Where the notebook hosts the store, if every worker reaches it (see
        :func:`~nbdist.runtime.env.store_addr`); None leaves it to rank 0's worker."""
        if self.stores is None:
            return None
        # The notebook's addresses only: no GPU count, so the notebook does not import torch
        controller = self.backend.controller_ip if self.backend else None
        addr = store_addr(rt.describe(controller, gpus=False), infos)
        if addr is None:
            return None
        if self.store is not None and (self.store.host != addr or not self.store.alive):
            self.store.close()
            self.store = None
        if self.store is None:
            self.store = self.stores(addr, self.options.timeout)
        return addr

    def _job_store_port(self, timeout: float) -> int:
        """The port of the job's store: the notebook's own when the plan's ``MASTER_ADDR``
        is its host's, else a store rank 0's worker opens (rank 0's death then ends the job
        for good; elastic training says so)."""
        rank0 = self.plans[0]
        if self.store is not None and self.master is not None and (
                self.store.host == self.master == rank0.master_addr):
            return self.store.port(timeout)
        if self.store is not None:
            self.store.close()
            self.store = None
        [port] = self.call([Call(rank0.worker_id, rt.open_store,
                                 (rank0.master_addr, "cluster", timeout))],
                           timeout, "open the rendezvous store")
        return port

    # ----------------------------------------------------------------- who is in the job
    def form(self, options: ClusterOptions) -> None:
        """Admit every worker the engine has, plan ranks by host, open the store on rank 0's
        host, and form the process group on every rank (each has ``options.timeout`` seconds
        to join, and 30 more for the call to return).

        Raises
        ------
        NoClusterError
            No backend is set.
        ClusterError
            The engine has no workers, ``--device cuda`` where a host has no GPU, nccl on ranks
            that share a GPU, a worker gone (``WorkersGone``), or a call that failed or did not
            answer in time (``WorkerCallFailed``).
        StoreError
            The notebook's store process failed or did not answer (a ``RuntimeError``).
        """
        self.options = options
        self.suspect.clear()  # the plan is made anew from the workers the engine has
        backend = self.require()
        ids = backend.worker_ids()
        if not ids:
            raise ClusterError("the cluster has no workers")
        timeout = options.timeout
        ids = self.ranked(ids)
        self.infos = {}
        self.deaths = {}
        infos = self.admit(ids)
        self.master = self._store_addr(infos)
        self.replan(ids)
        if options.device == "cuda" and any(p.gpu is None for p in self.plans):
            bad = sorted({p.hostname for p in self.plans if p.gpu is None})
            raise ClusterError(f"--device cuda, but no GPU is visible on {', '.join(bad)}")
        try:
            self.dist_backend, self.note = choose_dist_backend(options.dist_backend, self.plans)
        except ValueError as shared:
            raise ClusterError(
                f"--dist-backend nccl, but {shared}, and NCCL needs one GPU per rank. Start "
                "one worker per GPU (-n without a number picks that), or leave the dist "
                "backend at auto (gloo, on the shared GPUs), or --device cpu.") from None
        self.port = self._job_store_port(timeout)
        gen = self.invalidate()
        joined: list[Joined] = self.call(
            [Call(p.worker_id, rt.join, (p, self.port, options.device, self.dist_backend,
                                         timeout, gen),
                  {"working_dir": options.working_dir})
             for p in self.plans], timeout + 30, "form the process group")
        self.joined = {j["rank"]: j for j in joined}

    def admit(self, workers: Sequence[WorkerId]) -> list[WorkerInfo]:
        """Describe ``workers`` and give them the event channel: the one way a worker enters
        the job, when it forms and when a replacement takes a lost rank's place. Returns
        their ``describe()`` records, also kept in :attr:`infos`.

        Raises
        ------
        NoClusterError
            No backend is set.
        ClusterError
            A worker is gone, or did not answer within the job's ``timeout`` seconds
            (``WorkersGone``, ``WorkerCallFailed``).
        """
        backend = self.require()
        timeout = self.options.timeout
        # One job, one round trip: each worker runs its two calls in order (the same
        # arguments for all, which an engine may send as one message).
        where, channel = (backend.controller_ip,), (backend.transport(),)
        infos: list[WorkerInfo] = self.call(
            [Call(w, rt.describe, where) for w in workers]
            + [Call(w, rt.set_transport, channel) for w in workers], timeout,
            "describe workers and install the event channel")[:len(workers)]
        for w, info in zip(workers, infos):
            info["worker_id"] = w
            self.infos[w] = info
        return infos

    def ranked(self, workers: Sequence[WorkerId]) -> list[WorkerId]:
        """``workers`` in the order they take ranks when the job is formed again (a scale,
        a restart of ranks), the same on every engine whatever order it lists them in: those
        in the job now keep their ranks; workers new to the job take the ranks of workers
        that left, lowest first (a restarted rank's new process takes its rank back), then
        the next ranks, in the engine's order. A rank that left with no new worker to take
        it moves those above it down by one, keeping their order."""
        now = {p.worker_id: p.rank for p in self.plans}
        here = set(workers)
        fresh = [w for w in workers if w not in now]
        order = []
        for plan in sorted(self.plans, key=lambda p: p.rank):
            if plan.worker_id in here:
                order.append(plan.worker_id)
            elif fresh:  # its worker left: the first new worker takes its rank
                order.append(fresh.pop(0))
        return order + fresh

    def replan(self, workers: Sequence[WorkerId]) -> list[RankPlan]:
        """Make ``workers`` (admitted already) the job, ranked by host in this order, with the
        profile's variables; returns the new plans."""
        o = self.options
        held = {p.worker_id: p.gpu for p in self.plans if p.gpu is not None}  # kept by each
        plans = plan_ranks([self.infos[w] for w in workers], threads=o.threads,
                           use_gpus=o.device != "cpu", master=self.master, pinned=held)
        if o.env:  # the profile's variables, set and restored with torchrun's
            plans = [replace(p, extra={**o.env, **p.extra}) for p in plans]
        self.plans = plans
        return plans

    def invalidate(self) -> int:
        """Every rank's group is out of date from now on: the next full cell forms a new one
        (or an elastic plan names it). Returns the new generation."""
        self.generation += 1
        return self.generation

    def distrust(self, workers: Sequence[WorkerId]) -> None:
        """The engine failed these workers' calls: they may be gone; the next job checks."""
        self.suspect.update(workers)

    def release(self) -> Optional[Backend]:
        """Forget the job (its backend, plans, store); returns the backend, to stop it."""
        backend, self.backend = self.backend, None
        self.plans, self.joined, self.port = [], {}, None
        store, self.store = self.store, None
        if store is not None:
            store.close()
        return backend

    # ----------------------------------------------------------------- calls
    def submit(self, calls: list[Call]) -> Submission:
        """``backend.submit``, refusing at once when a planned worker is known to be gone.

        After the engine failed a call, the next job first asks the engine which workers it
        still has (one round trip, only then): a call to a dead worker would otherwise fail
        with the engine's own error, or, on Dask, wait for the process group's timeout.

        Parameters
        ----------
        calls : list of Call
            One function call per entry, each on its worker.

        Returns
        -------
        Submission
            The calls in flight: wait on it, read their outcomes.

        Raises
        ------
        NoClusterError
            No backend is set.
        WorkersGone
            A planned worker is gone (the error names its ranks and hosts, and what to do).
        """
        backend = self.require()
        if self.suspect:
            live = set(backend.worker_ids())
            gone = [p for p in self.plans if p.worker_id not in live]
            if gone:
                raise WorkersGone([p.rank for p in gone], [p.hostname for p in gone],
                                  owned=backend.owns_cluster, world_size=self.world_size)
            self.suspect.clear()
        try:
            return backend.submit(calls)
        except WorkerGone as exc:
            lost = [p for p in self.plans if p.worker_id in set(exc.workers)]
            raise WorkersGone([p.rank for p in lost], [p.hostname for p in lost],
                              owned=backend.owns_cluster, world_size=self.world_size) from exc

    def call(self, calls: list[Call], timeout: float, what: str) -> list[Any]:
        """Run nbdist's own calls (not user code) and return their values, in call order;
        raise :class:`~nbdist.errors.WorkerCallFailed` when one fails or does not answer.

        Parameters
        ----------
        calls : list of Call
            One function call per entry, each on its worker.
        timeout : float
            Seconds to wait for all of them.
        what : str
            What the calls do, for the error (``"form the process group"``).

        Returns
        -------
        list
            Each call's return value, in call order.

        Raises
        ------
        NoClusterError
            No backend is set.
        WorkersGone
            A planned worker is gone (raised by :meth:`submit`, before anything runs).
        WorkerCallFailed
            A call did not answer within ``timeout`` seconds, or the engine failed it on a
            worker (the error names them, with the engine's text).
        KeyboardInterrupt
            Interrupted while waiting; the calls still running were interrupted first.
        """
        backend = self.require()
        job = self.submit(calls)
        try:
            ok = job.wait(timeout)
        except KeyboardInterrupt:
            backend.interrupt(job.pending())
            raise
        if not ok:
            raise WorkerCallFailed(what, late=job.pending(), timeout=timeout)
        outcomes = job.outcomes()
        errors = {o.worker: o.engine_error for o in outcomes if o.engine_error is not None}
        if errors:
            raise WorkerCallFailed(what, errors=errors)
        return [o.value for o in outcomes]

    def status(self) -> ClusterStatus:
        """One row per worker: rank, host, pid, device, alive, memory (a worker that does
        not answer within 10 seconds is shown busy, or gone).

        Raises
        ------
        NoClusterError
            No backend is set.
        """
        backend = self.require()
        live = set(backend.worker_ids())
        rows = []
        by_worker = {p.worker_id: p for p in self.plans}
        reports: dict[Any, Optional[results.WorkerStatus]] = {}
        job = backend.submit([Call(w, rt.status) for w in live])
        if job.wait(10):
            for o in job.outcomes():
                reports[o.worker] = o.value if o.engine_error is None else None
        for w in sorted(set(by_worker) | live, key=str):
            plan, rep = by_worker.get(w), reports.get(w)
            rows.append(WorkerRow(
                rank=plan.rank if plan else None, worker=str(w),
                hostname=rep["hostname"] if rep else (plan.hostname if plan else "?"),
                pid=rep["pid"] if rep else getattr(self.deaths.get(w), "pid", None),
                device=rep["device"] if rep else None,
                alive=w in live and rep is not None,
                rss_mb=(rep["rss"] / 2**20) if rep and rep["rss"] else None,
                state="idle" if rep else ("busy" if w in live else self._gone(w))))
        rows.sort(key=lambda r: (r.rank is None, r.rank if r.rank is not None else 0))
        joined = next(iter(self.joined.values()), None)
        return ClusterStatus(engine=backend.describe(), wanted=self.options.n or len(rows),
                             rows=tuple(rows), dist_backend=joined["backend"] if joined else None,
                             master=self.plans[0].master_addr if self.plans else None)

    def _gone(self, w: WorkerId) -> str:
        """A worker's state once it is gone: how it died, in its error's words, where the
        notebook knows (``died: SIGKILL, last seen at line 7 of In [5]``)."""
        lost = self.deaths.get(w)
        return f"died: {lost.reason}" if lost is not None else "gone"
