"""The facade that magics, widgets and Python code all call.

A Session composes the job's :class:`~nbdist.group.membership.Membership` (who is in it: workers,
rank plans, store, generation) and runs each cell as a :class:`~nbdist.cell.loop.CellRun` (the
cell loop). Commands flow down (Session → backend → worker runtime); results and events flow
back up: the cell run turns results into errors and feeds events into the run's record
(:class:`~nbdist.telemetry.run.Run`), whose snapshots the views draw.
"""

from __future__ import annotations

import ast
import os
import threading
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from html import escape
from typing import Any, Callable, Optional

from .backends import get_backend
from .backends.base import Backend, Call
from .boot.store_host import StoreHost
from .boot.template import forks_store
from .cell.end_marks import EndMarks
from .cell.loop import CellRun, cell_name
from .debugger.console import for_call, post_mortem
from .debugger.faults import Faults
from .display import make_run_view, make_start_view
from .elastic.coordinator import Coordinator
from .errors import PARTIAL_RANKS, NbdistError, NoClusterError, OptionError
from .exporter.history import History
from .group.membership import Membership
from .group.relaunch import relaunch
from .group.transfer import Transfers
from .options import CellDefaults, CellOptions, ClusterOptions, parse_ranks
from .records import ClusterStatus, Comparison, RemoteValue, TuneResult
from .runtime import worker as rt
from .runtime.env import count_local_gpus
from .runtime.measure.spec import DDPSettings, Measure
from .telemetry.compare import compare
from .telemetry.run import Run
from .telemetry.snapshot import RunSnapshot
from .tuning import DEFAULT_STEPS, Tuning


def _membership(name: str, doc: str) -> Any:
    """A read-only property of the session that reads the job's :class:`Membership`."""
    return property(lambda self: getattr(self.membership, name), doc=doc)


class Session:
    """A data-parallel job on warm workers: start or connect, then run cells on every rank.

    Examples
    --------
    >>> s = Session().start(n=2)                       # doctest: +SKIP
    >>> s.run_cell("import torch.distributed as dist; dist.get_world_size()")  # doctest: +SKIP
    2
    """

    def __init__(self, backends: Callable[[str], Backend] = get_backend,
                 stores: Optional[Callable[[str, float], StoreHost]] = StoreHost) -> None:
        #: makes a fresh backend for an engine name (tests pass a scripted one)
        self._backends = backends
        #: who is in the job; ``stores`` starts its notebook-side rendezvous store (None: rank
        #: 0's worker hosts it)
        self.membership = Membership(stores)
        self._target: dict[str, Any] = {}
        self._cells = 0
        self._id = uuid.uuid4().hex  # cells are named by it and their number, uniquely
        self._lock = threading.Lock()
        #: records of the latest runs that recorded telemetry, newest last
        self.runs: deque[Run] = deque(maxlen=3)
        #: what a cell does when its own flags say nothing (a profile's training section)
        self.defaults = CellDefaults()
        #: the profile file the session started from, if any
        self.profile_path: Optional[str] = None
        #: the cells and pushes since the process group formed, for :meth:`export`
        self.history = History()
        #: every run labelled with ``name=`` (``%%distributed --name``), kept for compare()
        self.named: dict[str, Run] = {}
        #: pushes and pulls, and their data channel (:mod:`nbdist.group.transfer`)
        self.transfers = Transfers()
        #: what ``%%distributed --tune`` chose, applied to DDP models built in later cells
        self.tuning = Tuning()
        #: faults asked for on purpose (``%nbdist kill --after``), due in the next cell
        self.faults = Faults()

    # ----------------------------------------------------------------- lifecycle
    def start(self, n: Optional[int] = None, *, profile: Any = None,
              engine: Optional[str] = None, device: Optional[str] = None,
              dist_backend: Optional[str] = None, timeout: Optional[float] = None,
              threads: Optional[int] = None, template: Optional[bool] = None) -> Session:
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
            from .profiles import Profile, load_profile, to_options

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
                threads: Optional[int] = None, **target: Any) -> Session:
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

    def restart(self) -> Session:
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

    def _launch(self, options: ClusterOptions, target: Optional[dict[str, Any]]) -> Session:
        """Start workers (``target`` None) or attach to ``target``; then form the job."""
        self.stop()
        backend = self._backends(options.engine)
        m = self.membership
        view = make_start_view()  # "k of n ready" while they come up
        if target is None and options.launch.local:  # workers here reach the store on loopback
            if forks_store(options):  # from the template, ready once it forked the workers
                view = m.warming_store(view, options.timeout)
            else:
                m.warm_store(options.timeout)
        if target is None:
            backend.launch = options.launch
            backend.on_ready = view
            backend.start(options.n or 2, options.timeout)
        else:
            backend.connect(options.timeout, **target)
        self._target = dict(target or {})
        m.backend = backend
        try:
            self._form(replace(options, n=len(backend.worker_ids())))
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self, options: ClusterOptions) -> None:
        self.membership.form(options)
        self.history.reset()  # a new group: what ran before is not this job's script
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
        self.transfers.close()
        backend = self.membership.release()
        if backend is None:
            return None
        what, owned = backend.describe(), backend.owns_cluster
        backend.stop()
        if owned:
            return f"stopped {n} worker{'s' if n != 1 else ''} of {what}"
        return f"disconnected from {what}; its {n} worker{'s' if n != 1 else ''} keep running"

    def scale(self, n: int) -> Session:
        """Make the cluster ``n`` workers and re-form the process group at the new size.

        Worker namespaces survive on workers that stay, but models wrapped in
        DistributedDataParallel and optimizers must be rebuilt for the new world size.

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
        backend.scale(n, self.options.timeout)
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

    # ----------------------------------------------------------------- cells
    def run_cell(self, code: str, *, ranks: Optional[str] = None,
                 timeout: Optional[float] = None, output: Optional[str] = None,
                 telemetry: Optional[bool] = None, time_collectives: Optional[bool] = None,
                 first_line: int = 1, execution_count: Optional[int] = None,
                 name: Optional[str] = None, stall_after: Optional[float] = None,
                 bucket_timing: Optional[bool] = None) -> Optional[RemoteValue]:
        """Run ``code`` on every rank (or ``ranks``, e.g. ``"0,2-3"``) as one job.

        Returns the value of the last expression on the lowest selected rank, for display.
        Raises :class:`~nbdist.errors.DistributedError` naming the failing ranks. With
        ``telemetry`` (default), steps and gradient all-reduces are timed and shown live, and
        so are ``torch.distributed`` collectives called in the cell unless
        ``time_collectives=False``; see ``docs/telemetry.md``. Options left at None take the
        session's :attr:`defaults` (a profile's ``training`` section). A ``name`` labels the
        run: named runs are all kept (a name used again is replaced) and :meth:`compare` shows
        them. ``stall_after`` is the hang doctor's threshold in seconds (default five median
        steps, at least 10 s; 0: off): past it without a completed step or collective, the
        dashboard says where each rank is (``docs/fault-tolerance.md``). ``bucket_timing``
        times each gradient bucket's all-reduce of DDP models built in the cell on CPU (a
        Python comm hook: a few per cent slower on small, fast steps) instead of one span per
        step from DDP's own timer.

        Tracebacks number lines from ``first_line`` (``%%distributed`` passes 2: its own line
        is the editor's line 1) and name the cell ``In [execution_count]`` when given.
        ``timeout`` is in seconds (default: the profile's ``training.cell_timeout``, else
        none); time at a debugger prompt does not count. ``output`` is ``"rank0"``, ``"all"``
        or ``"quiet"``.

        Raises
        ------
        OptionError
            A bad option: ``ranks`` outside the job, ``timeout`` not positive, a negative
            ``stall_after``, an unknown ``output``, a blank ``name``.
        NoClusterError
            No job is running.
        SyntaxError
            ``code`` does not parse; raised before anything is sent.
        DistributedError
            The cell raised on one or more ranks; the error names each, with its host and
            traceback (``DebuggerQuit`` when ``q`` in a rank's debugger ended it).
        CellTimeoutError
            The cell ran past ``timeout`` seconds: interrupted on every rank, and the error
            says where each rank was.
        CellInterrupted
            The kernel was interrupted (a ``KeyboardInterrupt``); the ranks were stopped.
        ClusterError
            A rank's worker is gone (``WorkersGone``, before the cell starts), or ranks an
            interrupt could not stop in time (``InterruptTimeoutError``).
        """
        d = self.tuning.defaults(self.defaults)  # the tuned DDP setting, if any, applies
        output = d.output if output is None else output
        timeout = d.timeout if timeout is None else timeout
        opts = CellOptions(ranks=ranks, timeout=timeout, output=output, name=name,
                           stall_after=stall_after)
        measure = d.measure.override(telemetry=telemetry, collectives=time_collectives,
                                     buckets=bucket_timing, stall_after=opts.stall_after)
        return self._run(code, opts, measure, first_line, execution_count)[0]

    def _run(self, code: str, opts: CellOptions, measure: Measure, first_line: int,
             execution_count: Optional[int], trial: bool = False
             ) -> tuple[Optional[RemoteValue], Run]:
        """Run ``code`` as one cell: its value and its run (a ``trial`` is not history)."""
        m = self.membership
        m.require()
        selected = parse_ranks(opts.ranks, self.world_size)
        with self._lock:
            self._cells += 1
            number = self._cells
            cell = cell_name(number, execution_count)
        # Blank lines in place of the lines before the code (the magic's own line): every line
        # number Python reports, in tracebacks and syntax errors alike, is then the editor's.
        shipped = "\n" * max(0, first_line - 1) + code
        ast.parse(shipped, cell.filename, "exec")  # a syntax error is raised here, before shipping
        cell_id = f"{self._id}-{number}"
        # The cell loop's companions: the debugger's console, which answers the ranks' prompts
        # (breakpoint(), input()) through the notebook's stdin, and the kills due in this cell
        link, console = for_call(m, cell_id)
        beside: list[Any] = [console, *self.faults.for_call(m)]
        elastic = m.store is not None and len(selected) == self.world_size
        if m.store is not None and len(selected) > 1:  # the notebook marks ranks that end
            beside.append(EndMarks(m.store, cell_id, selected))
        # One call for every rank (the lowest one returns the value): the engine packs it once
        args = (shipped, cell.filename, cell_id, self.generation, list(selected), None)
        kwargs = {"measure": measure, "coordinated": elastic, "link": link,
                  "mark_end": m.store is None}
        calls = [Call(self.plans[r].worker_id, rt.run_cell, args, kwargs) for r in selected]
        run = Run("cell", selected, world_size=self.world_size, generation=self.generation,
                  name=opts.name, stall_after=measure.stall_after)
        run.label = cell.label
        if not trial:  # what its verdicts may compare it with, once it is over
            run.context = lambda: self.tuning.context(self.named, opts.name)
        view = make_run_view(opts.output, selected[0], self.world_size, ranks=selected)
        hint = ""
        if len(selected) < self.world_size:
            hint = PARTIAL_RANKS.format(ranks=", ".join(map(str, selected)))
        coordinator = (Coordinator(m, measure,
                                   default_max_failures=self.defaults.elastic_max_failures)
                       if elastic else None)
        cell_run = CellRun(m, calls, run, view, coordinator=coordinator, hint=hint,
                           companions=beside)
        try:
            outcomes = cell_run.wait(opts.timeout)
        finally:
            if cell_run.reformed:
                self.history.reset()  # a new group: the exported script starts after it
            if run.recorded:
                self.runs.append(run)
            if opts.name is not None:
                self.named.pop(opts.name, None)  # a re-run goes to the end, in run order
                self.named[opts.name] = run
        if not trial:  # a tuning's trials are one cell of the script: tune() adds it
            self.history.cell(number, code, None if len(selected) == self.world_size else selected)
        self.tuning.say_note(run.snapshot(), self.defaults, opts.output)  # under the cell
        value = outcomes[0]["value"]
        return (RemoteValue(selected[0], value) if value else None), run

    def tune(self, code: str, steps: int = DEFAULT_STEPS, *, timeout: Optional[float] = None,
             time_collectives: Optional[bool] = None, bucket_timing: Optional[bool] = None,
             stall_after: Optional[float] = None, first_line: int = 1,
             execution_count: Optional[int] = None, quiet: bool = False) -> TuneResult:
        """``%%distributed --tune``: run ``code`` as trials of ``steps`` optimizer steps, each
        with one DDP setting; the fastest exact one becomes the default of DDP models built
        later. Returns the table, fastest first (``docs/tuning.md``); raises ``TuneError``.
        ``timeout`` is each trial's, in seconds (default: from the first trial's time).

        Raises
        ------
        OptionError
            Fewer ``steps`` than a trial needs, or a bad option value.
        NoClusterError
            No job is running.
        SyntaxError
            ``code`` does not parse; raised before the first trial.
        TuneError
            The cell builds no DDP model, or ends before ``steps`` steps; nothing changes.
        DistributedError, CellTimeoutError
            The cell fails (or runs past ``timeout``) with torch's defaults; a trial of
            another setting that fails is only left out.
        """
        self.membership.require()
        ast.parse(code)  # a syntax error before the first trial
        trial, limit = self.tuning.trials(
            partial(self._run, code, first_line=first_line, execution_count=execution_count,
                    trial=True), self.named, self.defaults, steps,
            timeout, time_collectives, bucket_timing, stall_after)
        joined = next(iter(self.membership.joined.values()), {"backend": "gloo"})
        result = self.tuning.tune(trial, steps, joined["backend"], timeout=limit,
                                  say=(lambda line: None) if quiet else print)
        self.history.cell(self._cells, code, None)
        return result

    def tune_settings(self) -> DDPSettings:
        """The DDP setting of models built from now on: the tuned one, else the profile's."""
        return self.tuning.defaults(self.defaults).measure.ddp

    def tune_show(self) -> str:
        """``%nbdist tune show``: that setting and where it comes from, in words."""
        return self.tuning.show(self.defaults)

    def tune_reset(self) -> str:
        """``%nbdist tune reset``: drop the tuned setting; returns what applies again."""
        return self.tuning.reset(self.defaults)

    def run_script(self, path: str, argv: Sequence[str] = (), *,
                   timeout: Optional[float] = None, output: str = "rank0") -> None:
        """Run a script written for ``torchrun`` on every rank, unchanged, in fresh processes
        (``timeout``: seconds before it is stopped on every rank; default none).

        Raises
        ------
        NoClusterError
            No job is running.
        FileNotFoundError
            The script cannot be read.
        DistributedError
            The script failed on one or more ranks (the error names them).
        CellTimeoutError, CellInterrupted
            It ran past ``timeout`` seconds, or the kernel was interrupted.
        ClusterError
            A rank's worker is gone, or the script's rendezvous store could not be opened.
        RuntimeError
            The notebook's rendezvous store process failed (``StoreError``).
        """
        m = self.membership
        m.require()
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except OSError as exc:
            raise FileNotFoundError(f"cannot read script {path!r}: {exc.strerror}") from exc
        port = m.open_store("run", "the script's rendezvous store")
        try:
            run_id = uuid.uuid4().hex[:12]  # fresh per launch, as torchrun --standalone does
            calls = [Call(p.worker_id, rt.run_script,
                          (os.path.abspath(path), source, list(argv), port, os.getcwd(),
                           run_id))
                     for p in self.plans]
            run = Run(f"script {os.path.basename(path)}", range(self.world_size),
                      world_size=self.world_size, generation=self.generation)
            CellRun(m, calls, run, make_run_view(output, 0, self.world_size)).wait(timeout)
        finally:
            m.close_store("run")

    @property
    def last_run(self) -> Optional[RunSnapshot]:
        """Summary of the latest run that recorded telemetry (None before any)."""
        return self.runs[-1].snapshot() if self.runs else None

    def timeline(self, path: str, run: int = -1) -> int:
        """Write a recorded run (default: the latest) as a Chrome trace; return its event count.

        Open the file in https://ui.perfetto.dev or chrome://tracing: one track per rank, with
        steps, forward/backward and each gradient bucket's all-reduce. ``run`` indexes
        :attr:`runs` (the last three).

        Raises
        ------
        NbdistError
            No run has recorded telemetry yet.
        IndexError
            ``run`` is not the index of a recorded run.
        OSError
            The file cannot be written.
        """
        if not self.runs:
            raise NbdistError("no telemetry recorded yet: run a %%distributed cell (without "
                              "--no-telemetry) first, then %nbdist timeline FILE.json")
        return self.runs[run].write_trace(path)

    def compare(self, *names: str) -> Comparison:
        """Named runs side by side (all of them, or ``names`` in that order).

        Raises
        ------
        NbdistError
            No run has a name yet.
        OptionError
            A name in ``names`` labels no run (the message lists those that do).
        """
        if not self.named:
            raise NbdistError("no named runs yet: label runs with %%distributed --name LABEL "
                              "(Python: run_cell(code, name=...)), then compare them")
        unknown = [n for n in names if n not in self.named]
        if unknown:
            raise OptionError(f"no run named {', '.join(map(repr, unknown))}; named runs: "
                              f"{', '.join(self.named)}")
        chosen = {n: self.named[n].snapshot() for n in (names or self.named)}
        return Comparison(compare(chosen, self.tuning.known()))

    # ----------------------------------------------------------------- data
    def push(self, values: dict[str, Any], *, ranks: Optional[str] = None) -> None:
        """Send notebook values to every worker's namespace (``%nbdist push NAME...``), or
        to ``ranks`` (as :func:`~nbdist.options.parse_ranks` reads them).

        Raises
        ------
        NoClusterError
            No job is running.
        OptionError
            ``ranks`` names a rank the job does not have.
        TypeError, pickle.PicklingError
            A value cannot be pickled (a lock, an open file, a generator).
        ClusterError
            A rank's worker is gone, or the push failed there or did not end within the
            cluster's ``timeout`` seconds (``WorkerCallFailed``).
        """
        self.membership.require()
        selected = parse_ranks(ranks, self.world_size)
        packed = self.transfers.push(self.membership, values, selected)
        self.history.push(values, None, None if len(selected) == self.world_size else selected,
                          size=packed.nbytes)

    def pull(self, name: str, *, rank: int = 0) -> Any:
        """Bring ``name`` from rank ``rank`` into the notebook (tensors and modules on CPU).

        ``name`` may be a dotted path (``"model.fc.weight"``).

        Raises
        ------
        NoClusterError
            No job is running.
        OptionError
            ``rank`` is not a rank of the job.
        NameError
            The rank has no such name, or the value is over 2 GiB or cannot be pickled (the
            message names the rank and says which).
        ClusterError
            The rank's worker is gone, or the pull failed or did not end within the cluster's
            ``timeout`` seconds (``WorkerCallFailed``).
        TimeoutError
            Its large buffers did not arrive over the data channel within that time.
        """
        self.membership.require()
        parse_ranks(str(rank), self.world_size)
        return self.transfers.pull(self.membership, name, rank)

    # ----------------------------------------------------------------- debugger, faults
    def debug(self, rank: Optional[int] = None) -> int:
        """Post-mortem pdb on the frame where the last cell failed on ``rank`` (default: the
        first rank that failed), answered in the notebook (``%nbdist debug``); returns the
        rank. See ``docs/debugging.md``.

        Raises
        ------
        NoClusterError
            No job is running.
        OptionError
            ``rank`` is not a rank of the job.
        DebuggerUnavailable
            No one can answer here: rank 0's worker hosts the store, or the kernel takes no
            input (nbclient, papermill).
        NothingToDebug
            No rank's last cell failed, or ``rank``'s did not (the message names those that did).
        DistributedError
            The debugger itself failed on the rank.
        ClusterError
            A rank's worker is gone (``WorkersGone``).
        """
        return post_mortem(self.membership, rank)

    def kill(self, rank: int, signal: str = "SIGKILL", *, after: Optional[float] = None) -> str:
        """Send ``signal`` to ``rank``'s worker process from outside it, now or ``after``
        seconds into the next cell (``%nbdist kill``); returns what it did, in words.
        ``signal`` is a name (``"SIGTERM"``, ``"term"``) or a number (``"9"``).

        Raises
        ------
        NoClusterError
            No job is running.
        OptionError
            ``rank`` is not a rank of the job, ``signal`` names no signal, or ``after`` < 0.
        ClusterError
            The engine cannot signal the worker.
        """
        return self.faults.kill(self.membership, rank, signal, after)

    def hang(self, rank: int, seconds: float = 60.0) -> str:
        """Make ``rank`` hold for ``seconds`` at its next collective (``%nbdist hang``);
        returns what it did, in words.

        Raises
        ------
        NoClusterError
            No job is running.
        OptionError
            ``rank`` is not a rank of the job, or ``seconds`` is not more than 0.
        ClusterError
            The rank's worker is gone or did not answer (``WorkerCallFailed``).
        """
        return self.faults.hang(self.membership, rank, seconds)

    # ----------------------------------------------------------------- notebook to job
    def export(self, path: str, *, force: bool = False) -> Any:
        """Write the cells that ran successfully since the group formed as a torchrun script.

        Pushed values the cells read go in as code (literals) or in ``<stem>.data.pkl`` next
        to the script. Returns an :class:`~nbdist.exporter.torchrun.Export` (its ``command`` is the
        launch line). A file nbdist did not write is not overwritten unless ``force``.
        See ``docs/export.md``.

        Raises
        ------
        NoClusterError
            No job is running.
        ExportError
            No cell ran successfully since the group formed, or ``path`` is a file nbdist did
            not write (and not ``force``).
        OSError
            The files cannot be written.
        """
        from ._version import __version__
        from .exporter.torchrun import write

        m = self.membership
        m.require()
        options = replace(self.options, dist_backend=m.dist_backend)  # gloo on shared GPUs
        return write(path, self.history.entries, self.plans, options, self.profile_path,
                     version=__version__, force=force)

    def save_profile(self, path: str) -> str:
        """Write this session's options as a profile that ``start(profile=path)`` reads;
        returns ``path``.

        Raises
        ------
        NoClusterError
            No job is running.
        OSError
            The file cannot be written.
        """
        from .profiles import dump_profile, from_options

        backend = self.membership.require()
        header = f"nbdist profile saved from a session on {backend.describe()}.\n"
        if not backend.owns_cluster:
            header += "That session was connected to its cluster; this starts one like it.\n"
        header += f"Start it with: %nbdist start --profile {os.path.basename(path)}"
        text = dump_profile(from_options(self.options, self.tuning.defaults(self.defaults)),
                            header)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def dask_client(self) -> Any:
        """A ``distributed.Client`` on these same workers, for Dask-ML, XGBoost, LightGBM.

        The Dask engine's own client; on ipyparallel, the engines become Dask workers too
        (ipyparallel's ``become_dask``). Do not close it: ``nbdist.stop()`` does.

        Raises
        ------
        NoClusterError
            No job is running.
        MissingPackageError
            On ipyparallel, Dask's ``distributed`` package is not installed.
        ClusterError
            The engine cannot serve Dask work.
        """
        return self.membership.require().dask_client()

    def __repr__(self) -> str:
        if self.backend is None:
            return "<nbdist.Session: not running>"
        return (f"<nbdist.Session: {self.backend.describe()}, world_size={self.world_size}, "
                f"generation={self.generation}>")

    def _repr_html_(self) -> str:
        """In a notebook, a session shows its workers (what ``nbdist.start()`` returns)."""
        if self.backend is None:
            return "<p><b>nbdist</b>: not running</p>"
        try:
            return self.status()._repr_html_()
        except NbdistError as exc:  # a repr must not raise; say what is wrong instead
            return f"<p><b>nbdist</b>: {escape(str(exc))}</p>"


_default: Optional[Session] = None


def default_session() -> Session:
    """The notebook's session, shared by magics, widgets and the module-level API."""
    global _default
    if _default is None:
        _default = Session()
    return _default
