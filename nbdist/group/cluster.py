"""The cluster: the workers an engine runs and the process group formed on them.

:class:`Cluster` starts workers (or attaches to a running cluster), forms the job on them
through its :class:`~nbdist.group.membership.Membership`, re-forms it at another size, reports
its status and stops it: the lifecycle every session has, whatever it then runs on the
workers. :class:`~nbdist.session.Session` is a Cluster that also runs cells, moves data,
debugs, tunes and exports; torch elastic's agent works on its ``WorkerGroup`` the same way,
and a re-run start cell keeps warm workers (:mod:`.relaunch`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from html import escape
from typing import Any, Callable, Optional, Self

from ..backends import get_backend
from ..backends.base import Backend
from ..boot.store_host import StoreHost
from ..errors import NbdistError, NoClusterError, OptionError
from ..options import CellDefaults, ClusterOptions
from ..records import ClusterStatus
from ..runtime.env import count_local_gpus
from .losses import remove_leftovers
from .membership import Membership
from .relaunch import Progress, launch, relaunch


def _membership(name: str, doc: str) -> Any:
    """A read-only property of the cluster that reads the job's :class:`Membership`."""
    return property(lambda self: getattr(self.membership, name), doc=doc)


class Cluster:
    """The workers of one job and the process group on them: start or connect, scale, stop.

    Parameters
    ----------
    backends
        Makes a fresh backend for an engine name (tests pass a scripted one).
    stores
        Starts the notebook-side rendezvous store on an address, within a timeout in seconds
        (None: rank 0's worker hosts it).
    start_view
        Makes what is told ``(ready, wanted)`` while workers come up (the session passes the
        notebook's "k of n ready"; None shows nothing).
    """

    def __init__(self, backends: Callable[[str], Backend] = get_backend,
                 stores: Optional[Callable[[str, float], StoreHost]] = StoreHost,
                 start_view: Optional[Callable[[], Optional[Progress]]] = None) -> None:
        self._backends = backends
        #: who is in the job: backend, rank plans, store, generation
        self.membership = Membership(stores)
        self._target: dict[str, Any] = {}
        self._start_view = start_view or (lambda: None)
        #: what a cell does when its own flags say nothing (a profile's training section)
        self.defaults = CellDefaults()
        #: the profile file the cluster started from, if any
        self.profile_path: Optional[str] = None

    def start(self, n: Optional[int] = None, *, profile: Any = None,
              engine: Optional[str] = None, device: Optional[str] = None,
              dist_backend: Optional[str] = None, timeout: Optional[float] = None,
              threads: Optional[int] = None, template: Optional[bool] = None) -> Self:
        """Start ``n`` workers (default: one per GPU, else 2) and form the job.

        ``profile`` is a YAML file (or a :class:`~nbdist.profiles.Profile`) saying where and
        how (see ``docs/profiles.md``); the other arguments override it. Without one, the
        workers start on this machine, on loopback. A bad profile raises
        :class:`~nbdist.errors.ProfileError` before anything starts. ``template=False``
        starts each worker as a fresh process instead of forking it from the host's worker
        template (``docs/usage.md``, "Worker templates"). ``timeout`` is in seconds, for the
        start and for any collective (default 300); ``threads`` are torch's, per worker.
        Returns this session, running.

        Raises
        ------
        ProfileError
            The profile is missing, not YAML, or not valid (an ``OptionError``).
        OptionError
            A bad value or combination (``n=0``, nccl with ``device="cpu"``, an unknown engine).
        ImportError
            The engine's or the launcher's package is not installed; the message says which.
        ClusterError
            The workers did not start within ``timeout`` seconds, the launcher could not start
            them, or the job could not be formed on them; what started is stopped.
        RuntimeError
            The notebook's rendezvous store process failed (``StoreError``).
        """
        base, defaults, path = ClusterOptions(), CellDefaults(), None
        if profile is not None:
            from ..profiles import Profile, load_profile, to_options

            if not isinstance(profile, Profile):
                path = os.fspath(profile)
                profile = load_profile(path)
            base, defaults = to_options(profile)
        options = base.override(n=n, engine=engine, device=device, dist_backend=dist_backend,
                                timeout=timeout, threads=threads)
        if template is not None:
            options = replace(options, launch=replace(options.launch, template=template))
        if options.n is None and not options.launch.local:
            raise OptionError(f"the {options.launch.launcher!r} launcher needs a number of "
                              "workers: set `workers` in the profile's cluster section, or -n",
                              key="workers")
        if options.n is None:
            options = replace(options, n=count_local_gpus() or 2)
        if not self._keeps(options, None):
            self._launch(options, None)
        self.defaults, self.profile_path = defaults, path
        return self

    def connect(self, *, engine: Optional[str] = None, device: Optional[str] = None,
                dist_backend: Optional[str] = None, timeout: Optional[float] = None,
                threads: Optional[int] = None, **target: Any) -> Self:
        """Attach to a running cluster.

        ``target`` names it: ipyparallel ``cluster_id``, ``ipp_profile`` (the ipcluster
        profile's name; ``profile`` is its old spelling), ``url_file``; Dask
        ``address`` or ``scheduler_file``, and ``security`` for TLS. ``timeout`` is in
        seconds, to reach it and for any collective (default 300). Returns this session.

        Raises
        ------
        OptionError
            A bad option value, an unknown engine, or a target the engine cannot use.
        ImportError
            The engine's package is not installed.
        ClusterError
            The cluster cannot be reached or has no workers, or the job could not be formed.
        RuntimeError
            The notebook's rendezvous store process failed (``StoreError``).
        """
        options = ClusterOptions().override(engine=engine, device=device,
                                            dist_backend=dist_backend, timeout=timeout,
                                            threads=threads)
        if self._keeps(options, target):
            return self
        self._launch(options, target)
        self.defaults, self.profile_path = CellDefaults(), None
        return self

    def restart(self) -> Self:
        """Stop and start again with the same options (fresh processes, empty namespaces).

        Raises
        ------
        NoClusterError
            No job is running.
        ClusterError, ImportError, OptionError, RuntimeError
            As for :meth:`start` (or :meth:`connect`, for a cluster it attached to).
        """
        if self.backend is None:
            raise NoClusterError()
        owned = self.backend.owns_cluster
        return self._launch(self.options, None if owned else dict(self._target))

    def _keeps(self, options: ClusterOptions, target: Optional[dict[str, Any]]) -> bool:
        """While a job runs: True when it is what ``options`` and ``target`` ask for (kept);
        else what :meth:`_launch` will stop and lose is said first. See :mod:`.group.relaunch`."""
        if self.backend is None:
            return False
        decision = relaunch(self.membership, self._target, options, target)
        print(f"nbdist: {decision.message}", flush=True)
        return decision.keep

    def _launch(self, options: ClusterOptions, target: Optional[dict[str, Any]]) -> Self:
        """Start workers (``target`` None) or attach to ``target``; then form the job."""
        self.stop()
        backend = self._backends(options.engine)
        launch(self.membership, backend, options, target, self._start_view())
        self._target = dict(target or {})
        try:
            self._form(replace(options, n=len(backend.worker_ids())))
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self, options: ClusterOptions) -> None:
        """Form the process group on the workers the backend has (a subclass that keeps what
        ran on the group, as the session keeps its history, starts it again here)."""
        self.membership.form(options)
        if self.membership.note:  # e.g. ranks that share a GPU get gloo
            print(f"nbdist: {self.membership.note}", flush=True)

    def stop(self) -> Optional[str]:
        """Stop workers nbdist started (or disconnect from a cluster it attached to).

        Returns what was stopped, in words (None when nothing was running).

        Raises
        ------
        Exception
            The engine's own error when a cluster nbdist started fails to stop (its processes
            may still run); a client that fails to close is only logged.
        """
        n = self.world_size
        backend = self.membership.release()
        if backend is None:
            return None
        what, owned = backend.describe(), backend.owns_cluster
        backend.stop()
        remove_leftovers(self.membership)  # dead ranks' output files on this host
        if owned:
            return f"stopped {n} worker{'s' if n != 1 else ''} of {what}"
        return f"disconnected from {what}; its {n} worker{'s' if n != 1 else ''} keep running"

    def scale(self, n: int) -> Self:
        """Make the cluster ``n`` workers and re-form the process group at the new size.

        Ranks, the same on every engine: to shrink, the highest ranks leave; the workers that
        stay keep their ranks; new workers take the ranks of workers that left (lowest
        first), then the next ranks; a rank left with no new worker to take it moves the
        ranks above it down by one. Worker namespaces survive on workers that stay, but
        models wrapped in DistributedDataParallel and optimizers must be rebuilt for the new
        world size.

        Raises
        ------
        OptionError
            ``n`` is less than 1.
        NoClusterError
            No job is running.
        ClusterError
            nbdist did not start this cluster, it did not reach ``n`` workers within the
            cluster's ``timeout`` seconds, or the group could not be formed again.
        """
        if n < 1:
            raise OptionError(f"cannot scale to {n} workers: at least 1 is needed")
        backend = self.membership.require()
        # the highest ranks leave; the workers that stay keep their ranks (Membership.ranked)
        backend.scale(n, self.options.timeout, self.membership.ranked(backend.worker_ids()))
        self._form(replace(self.options, n=n))
        return self

    # ----------------------------------------------------------------- the job, read-only
    backend = _membership("backend", "The engine's adapter (None when not running).")
    options = _membership("options", "The cluster's :class:`~nbdist.options.ClusterOptions`.")
    plans = _membership("plans", "One :class:`~nbdist.runtime.env.RankPlan` per rank, in "
                                 "rank order.")
    generation = _membership("generation", "Bumped whenever the process group must be formed "
                                           "again before the next full cell.")
    port = _membership("port", "The job store's port (``MASTER_PORT``).")

    @property
    def running(self) -> bool:
        """Whether a job is running (started or attached to)."""
        return self.backend is not None

    @property
    def world_size(self) -> int:
        """Ranks in the job (0 when none runs)."""
        return len(self.plans)

    def status(self) -> ClusterStatus:
        """One row per worker: rank, host, pid, device, alive, memory (a worker that does
        not answer within 10 s is shown busy, or gone).

        Raises
        ------
        NoClusterError
            No job is running.
        """
        return self.membership.status()

    def __repr__(self) -> str:
        if self.backend is None:
            return f"<nbdist.{type(self).__name__}: not running>"
        return (f"<nbdist.{type(self).__name__}: {self.backend.describe()}, "
                f"world_size={self.world_size}, "
                f"generation={self.generation}>")

    def _repr_html_(self) -> str:
        """In a notebook, a session shows its workers (what ``nbdist.start()`` returns)."""
        if self.backend is None:
            return "<p><b>nbdist</b>: not running</p>"
        try:
            return self.status()._repr_html_()
        except NbdistError as exc:  # a repr must not raise; say what is wrong instead
            return f"<p><b>nbdist</b>: {escape(str(exc))}</p>"

