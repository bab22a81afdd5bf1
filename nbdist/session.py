"""The one stateful coordinator. Magics, widgets and Python code all call these methods.

Commands flow down (Session → backend → worker runtime); results and events flow back up: the
Session turns results into errors and feeds events into the run's record
(:class:`~nbdist.telemetry.run.Run`), whose snapshots the views draw.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from html import escape
from typing import Any, Callable, NamedTuple, Optional

import cloudpickle

from .backends import get_backend
from .backends.base import Backend, Call, Job, WorkerGone, poll_until
from .display import RunView, make_run_view
from .errors import (
    PARTIAL_RANKS,
    REBUILD_DDP,
    CellInterrupted,
    CellTimeoutError,
    ClusterError,
    DistributedError,
    InterruptTimeoutError,
    NbdistError,
    NoClusterError,
    OptionError,
    RankFailure,
    WorkersGone,
)
from .healing import Healer, Jobs
from .history import History
from .options import CellDefaults, CellOptions, ClusterOptions, parse_ranks
from .records import ClusterStatus, Comparison, RemoteValue, WorkerRow
from .rendezvous import StoreHost
from .runtime import results
from .runtime import worker as rt
from .runtime.env import LOOPBACK, RankPlan, plan_ranks, shared_gpus, store_addr
from .telemetry.compare import compare
from .telemetry.events import Batch
from .telemetry.run import Run
from .telemetry.snapshot import RunSnapshot

# After an interrupt, how long workers get to return before we call them unresponsive.
_INTERRUPT_GRACE = 15.0
# After a cell ends, how long we wait for its last output batches to arrive.
_EVENT_GRACE = 3.0
# How often the kernel looks at a running job: output and the dashboard move at this pace.
_POLL = 0.1


def count_local_gpus() -> int:
    """GPUs visible on this host, without initializing CUDA in the kernel."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
        return len(ids)
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


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
        #: starts the notebook-side rendezvous store (None: rank 0's worker hosts it)
        self._stores = stores
        self._store: Optional[StoreHost] = None
        self._infos: dict[Any, dict[str, Any]] = {}
        self._master: Optional[str] = None
        self.backend: Optional[Backend] = None
        self.options = ClusterOptions()
        self.plans: list[RankPlan] = []
        #: bumped whenever the process group must be formed again before the next full cell
        self.generation = 0
        self.port: Optional[int] = None
        self._joined: dict[int, dict[str, Any]] = {}
        self._target: dict[str, Any] = {}
        self._cells = 0
        self._lock = threading.Lock()
        self._suspect: set[Any] = set()  # workers whose last call the engine failed
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

    # ----------------------------------------------------------------- lifecycle
    def start(self, n: Optional[int] = None, *, profile: Any = None,
              engine: Optional[str] = None, device: Optional[str] = None,
              dist_backend: Optional[str] = None, timeout: Optional[float] = None,
              threads: Optional[int] = None) -> Session:
        """Start ``n`` workers (default: one per GPU, else 2) and form the job.

        ``profile`` is a YAML file (or a :class:`~nbdist.profiles.Profile`) saying where and
        how (see ``docs/profiles.md``); the other arguments override it. Without one, the
        workers start on this machine, on loopback. A bad profile raises
        :class:`~nbdist.errors.ProfileError` before anything starts.
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
        if options.n is None and not options.launch.local:
            raise OptionError(f"the {options.launch.launcher!r} launcher needs a number of "
                              "workers: set `workers` in the profile's cluster section, or -n",
                              key="workers")
        if options.n is None:
            options = replace(options, n=count_local_gpus() or 2)
        self._launch(options, None)
        self.defaults, self.profile_path = defaults, path
        return self

    def connect(self, *, engine: Optional[str] = None, device: Optional[str] = None,
                dist_backend: Optional[str] = None, timeout: Optional[float] = None,
                threads: Optional[int] = None, **target: Any) -> Session:
        """Attach to a running cluster.

        ``target`` names it: ipyparallel ``cluster_id``, ``profile``, ``url_file``; Dask
        ``address`` or ``scheduler_file``, and ``security`` for TLS.
        """
        options = ClusterOptions().override(engine=engine, device=device,
                                            dist_backend=dist_backend, timeout=timeout,
                                            threads=threads)
        self._launch(options, target)
        self.defaults, self.profile_path = CellDefaults(), None
        return self

    def restart(self) -> Session:
        """Stop and start again with the same options (fresh processes, empty namespaces)."""
        if self.backend is None:
            raise NoClusterError()
        owned = self.backend.owns_cluster
        return self._launch(self.options, None if owned else dict(self._target))

    def _launch(self, options: ClusterOptions, target: Optional[dict[str, Any]]) -> Session:
        """Start workers (``target`` None) or attach to ``target``; then form the job."""
        self.stop()
        backend = self._backends(options.engine)
        if target is None and options.launch.local and self._stores is not None:
            # Workers on this host reach a store here on loopback; it starts (importing torch)
            # while the engine starts its workers.
            self._store = self._stores(LOOPBACK, options.timeout)
        if target is None:
            backend.launch = options.launch
            backend.start(options.n or 2, options.timeout)
        else:
            backend.connect(options.timeout, **target)
        self._target = dict(target or {})
        self.backend = backend
        self.options = replace(options, n=len(backend.worker_ids()))
        try:
            self._form()
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self) -> None:
        """Describe workers, plan ranks by host, open the store on rank 0, join everyone."""
        self._suspect.clear()  # the plan is made anew from the workers the engine has
        backend = self._require()
        ids = backend.worker_ids()
        if not ids:
            raise ClusterError("the cluster has no workers")
        timeout = self.options.timeout
        infos = self._call([Call(w, rt.describe, (backend.controller_ip,)) for w in ids],
                           timeout, "describe workers")
        for w, info in zip(ids, infos):
            info["worker_id"] = w
        self._infos = {w: info for w, info in zip(ids, infos)}
        self._master = self._store_addr(infos)
        self.plans = self._plan(infos)
        if self.options.device == "cuda" and any(p.gpu is None for p in self.plans):
            bad = sorted({p.hostname for p in self.plans if p.gpu is None})
            raise ClusterError(f"--device cuda, but no GPU is visible on {', '.join(bad)}")
        shared = shared_gpus(self.plans) if self.options.dist_backend != "gloo" else {}
        if shared:
            (host, gpu), ranks = next(iter(shared.items()))
            raise ClusterError(
                f"ranks {ranks} would share GPU {gpu} on {host}, and NCCL needs one GPU per rank. "
                f"Start one worker per GPU (-n without a number picks that), or pass "
                "--dist-backend gloo to share GPUs, or --device cpu.")
        self._call([Call(p.worker_id, rt.set_transport, (backend.transport(),))
                    for p in self.plans], timeout, "install event channel")
        self.port = self._open_store(infos, timeout)
        self.generation += 1
        joined = self._call(
            [Call(p.worker_id, rt.join, (p, self.port, self.options.device,
                                         self.options.dist_backend, timeout, self.generation),
                  {"working_dir": self.options.working_dir})
             for p in self.plans], timeout + 30, "form the process group")
        self._joined = {j["rank"]: j for j in joined}
        self.history.reset()  # a new group: what ran before is not this job's script

    def _plan(self, infos: list[dict[str, Any]]) -> list[RankPlan]:
        """Ranks for ``infos`` (``describe()`` records), with the profile's variables."""
        plans = plan_ranks(infos, threads=self.options.threads,
                           use_gpus=self.options.device != "cpu", master=self._master)
        if self.options.env:  # the profile's variables, set and restored with torchrun's
            plans = [replace(p, extra={**self.options.env, **p.extra}) for p in plans]
        return plans

    def _store_addr(self, infos: list[dict[str, Any]]) -> Optional[str]:
        """Where the notebook hosts the store, if every worker reaches it (see
        :func:`~nbdist.runtime.env.store_addr`); None leaves it to rank 0's worker."""
        if self._stores is None:
            return None
        # The notebook's addresses only: no GPU count, so the notebook does not import torch
        addr = store_addr(rt.describe(self.backend.controller_ip if self.backend else None,
                                      gpus=False), infos)
        if addr is None:
            return None
        if self._store is not None and (self._store.host != addr or not self._store.alive):
            self._store.close()
            self._store = None
        if self._store is None:
            self._store = self._stores(addr, self.options.timeout)
        return addr

    def _open_store(self, infos: list[dict[str, Any]], timeout: float) -> int:
        """The port of the job's store: the notebook's own when the plan's ``MASTER_ADDR``
        is its host's, else a store rank 0's worker opens (rank 0's death then ends the job
        for good; elastic training says so)."""
        rank0 = self.plans[0]
        if self._store is not None and self._master is not None and (
                self._store.host == self._master == rank0.master_addr):
            return self._store.port(timeout)
        if self._store is not None:
            self._store.close()
            self._store = None
        [port] = self._call([Call(rank0.worker_id, rt.open_store,
                                  (rank0.master_addr, "cluster", timeout))],
                            timeout, "open the rendezvous store")
        return port

    def _invalidate_group(self) -> None:
        """Some rank's group is gone or suspect: every rank forms a new one at the next full
        cell (workers compare this generation with the one their group was formed at)."""
        self.generation += 1

    def stop(self) -> Optional[str]:
        """Stop workers nbdist started (or disconnect from a cluster it attached to).

        Returns what was stopped, in words (None when nothing was running).
        """
        backend, self.backend = self.backend, None
        n = len(self.plans)
        self.plans, self._joined, self.port = [], {}, None
        store, self._store = self._store, None
        if store is not None:
            store.close()
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
        """
        if n < 1:
            raise OptionError(f"cannot scale to {n} workers: at least 1 is needed")
        backend = self._require()
        backend.scale(n, self.options.timeout)
        self.options = replace(self.options, n=n)
        self._form()
        return self

    @property
    def running(self) -> bool:
        return self.backend is not None

    @property
    def world_size(self) -> int:
        return len(self.plans)

    def status(self) -> ClusterStatus:
        """One row per worker: rank, host, pid, device, alive, memory."""
        backend = self._require()
        live = set(backend.worker_ids())
        rows = []
        by_worker = {p.worker_id: p for p in self.plans}
        reports: dict[Any, Optional[dict]] = {}
        job = backend.submit([Call(w, rt.status) for w in live])
        if job.wait(10):
            for o in job.outcomes():
                reports[o.worker] = o.value if o.engine_error is None else None
        for w in sorted(set(by_worker) | live, key=str):
            plan, rep = by_worker.get(w), reports.get(w)
            rows.append(WorkerRow(
                rank=plan.rank if plan else None, worker=str(w),
                hostname=(rep or {}).get("hostname") or (plan.hostname if plan else "?"),
                pid=(rep or {}).get("pid"), device=(rep or {}).get("device"),
                alive=w in live and rep is not None,
                rss_mb=(rep["rss"] / 2**20) if rep and rep.get("rss") else None,
                state="idle" if rep else ("busy" if w in live else "gone")))
        rows.sort(key=lambda r: (r.rank is None, r.rank if r.rank is not None else 0))
        backend_name = next(iter(self._joined.values()), {}).get("backend")
        return ClusterStatus(engine=backend.describe(), wanted=self.options.n or len(rows),
                             rows=tuple(rows), dist_backend=backend_name,
                             master=self.plans[0].master_addr if self.plans else None)

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
        """
        d = self.defaults
        output = d.output if output is None else output
        telemetry = d.telemetry if telemetry is None else telemetry
        time_collectives = d.collective_timing if time_collectives is None else time_collectives
        bucket_timing = d.bucket_timing if bucket_timing is None else bucket_timing
        timeout = d.timeout if timeout is None else timeout
        opts = CellOptions(ranks=ranks, timeout=timeout, output=output, name=name,
                           stall_after=stall_after)
        self._require()
        selected = parse_ranks(opts.ranks, self.world_size)
        with self._lock:
            self._cells += 1
            number = self._cells
            cell = cell_name(number, execution_count)
        # Blank lines in place of the lines before the code (the magic's own line): every line
        # number Python reports, in tracebacks and syntax errors alike, is then the editor's.
        shipped = "\n" * max(0, first_line - 1) + code
        ast.parse(shipped, cell.filename, "exec")  # a syntax error is raised here, before shipping
        cell_id = uuid.uuid4().hex
        elastic = self._store is not None and len(selected) == self.world_size
        calls = [Call(self.plans[r].worker_id, rt.run_cell,
                      (shipped, cell.filename, cell_id, self.generation, list(selected),
                       r == selected[0]),
                      {"telemetry": telemetry, "collectives": time_collectives,
                       "buckets": bucket_timing, "coordinated": elastic,
                       "stall_after": opts.stall_after})
                 for r in selected]
        run = Run("cell", selected, world_size=self.world_size, generation=self.generation,
                  name=opts.name, stall_after=opts.stall_after)
        run.label = cell.label
        view = make_run_view(opts.output, selected[0], self.world_size, ranks=selected)
        hint = ""
        if len(selected) < self.world_size:
            hint = PARTIAL_RANKS.format(ranks=", ".join(map(str, selected)))
        try:
            outcomes = self._run(calls, run, view, opts.timeout, hint,
                                 elastic={"telemetry": telemetry,
                                          "collectives": time_collectives,
                                          "buckets": bucket_timing} if elastic else None)
        finally:
            if run.recorded:
                self.runs.append(run)
            if opts.name is not None:
                self.named.pop(opts.name, None)  # a re-run goes to the end, in run order
                self.named[opts.name] = run
        self.history.cell(number, code, None if len(selected) == self.world_size else selected)
        first = outcomes[0]
        if first.get("value"):
            return RemoteValue(selected[0], first["value"])
        return None

    def run_script(self, path: str, argv: Sequence[str] = (), *,
                   timeout: Optional[float] = None, output: str = "rank0") -> None:
        """Run a script written for ``torchrun`` on every rank, unchanged, in fresh processes."""
        self._require()
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except OSError as exc:
            raise FileNotFoundError(f"cannot read script {path!r}: {exc.strerror}") from exc
        rank0 = self.plans[0]
        store = self._store
        if store is not None:
            port = store.open("run")
        else:
            [port] = self._call([Call(rank0.worker_id, rt.open_store,
                                      (rank0.master_addr, "run", self.options.timeout))],
                                self.options.timeout, "open the script's rendezvous store")
        try:
            run_id = uuid.uuid4().hex[:12]  # fresh per launch, as torchrun --standalone does
            calls = [Call(p.worker_id, rt.run_script,
                          (os.path.abspath(path), source, list(argv), port, os.getcwd(),
                           run_id))
                     for p in self.plans]
            run = Run(f"script {os.path.basename(path)}", range(self.world_size),
                      world_size=self.world_size, generation=self.generation)
            self._run(calls, run, make_run_view(output, 0, self.world_size), timeout)
        finally:
            if store is not None:
                store.close_store("run")
            else:
                self._call([Call(rank0.worker_id, rt.close_store, ("run",))], 30,
                           "close store")

    @property
    def last_run(self) -> Optional[RunSnapshot]:
        """Summary of the latest run that recorded telemetry (None before any)."""
        return self.runs[-1].snapshot() if self.runs else None

    def timeline(self, path: str, run: int = -1) -> int:
        """Write a recorded run (default: the latest) as a Chrome trace; return its event count.

        Open the file in https://ui.perfetto.dev or chrome://tracing: one track per rank, with
        steps, forward/backward and each gradient bucket's all-reduce.
        """
        if not self.runs:
            raise NbdistError("no telemetry recorded yet: run a %%distributed cell (without "
                              "--no-telemetry) first, then %nbdist timeline FILE.json")
        return self.runs[run].write_trace(path)

    def compare(self, *names: str) -> Comparison:
        """Named runs side by side (all of them, or ``names`` in that order)."""
        if not self.named:
            raise NbdistError("no named runs yet: label runs with %%distributed --name LABEL "
                              "(Python: run_cell(code, name=...)), then compare them")
        unknown = [n for n in names if n not in self.named]
        if unknown:
            raise OptionError(f"no run named {', '.join(map(repr, unknown))}; named runs: "
                              f"{', '.join(self.named)}")
        chosen = {n: self.named[n].snapshot() for n in (names or self.named)}
        return Comparison(compare(chosen))

    def _run(self, calls: list[Call], run: Run, view: RunView, timeout: Optional[float],
             hint: str = "", elastic: Optional[dict[str, Any]] = None
             ) -> list[results.CellResult]:
        """Submit per-rank calls, stream their events into ``run`` and ``view``, and turn
        failures into one error. Returns each call's result, in call order.

        With ``elastic`` (the cell's telemetry options), ``nbdist.elastic.run`` calls in the
        cell are coordinated (see :mod:`nbdist.healing`)."""
        rank_of = {p.worker_id: p.rank for p in self.plans}
        hosts = {p.worker_id: p.hostname for p in self.plans}
        job = self._submit(calls)
        healer = None
        if elastic is not None:
            healer = self._healer(job, elastic)
            job = Jobs(job, healer)

        def slot_of(w: Any) -> int:  # a replacement worker reports as the rank it replaced
            return healer.slots[w] if healer is not None else rank_of[w]
        start = time.monotonic()
        try:
            while True:
                done = job.wait(_POLL)
                self._pump(job, run, view, healer)
                if done:
                    break
                if healer is not None and healer.wrap_up_needed(job.pending()):
                    healer.wrap_up()  # training ended before a replacement got in
                if timeout is not None and time.monotonic() - start > timeout:
                    late = sorted(slot_of(w) for w in job.pending())
                    self._interrupt(job)
                    self._invalidate_group()
                    self._finish(job, run, view, healer)  # with where each rank said it was
                    raise CellTimeoutError(timeout, late, hint, run.where(), run.label)
        except KeyboardInterrupt:
            late = sorted(slot_of(w) for w in job.pending())
            self._interrupt(job)
            self._invalidate_group()
            self._finish(job, run, view, healer)
            raise CellInterrupted(late, run.where(), run.label, run.what) from None
        finally:
            self._finish(job, run, view, healer)
        outcomes = job.outcomes()
        if healer is not None and healer.final() is not None:
            outcomes = self._after_elastic(healer, outcomes)
            rank_of = dict(healer.slots)
            hosts.update({w: i.get("hostname", "?") for w, i in healer.infos.items()})
        out = [o.value if o.engine_error is None else results.engine_failure(o.engine_error)
               for o in outcomes]
        # The engine failed these calls: their worker may be gone; check before the next job.
        self._suspect.update(o.worker for o in outcomes if o.engine_error is not None)
        if any(not r.get("group_alive", True) for r in out):
            self._invalidate_group()
        failures = [RankFailure.from_result(rank_of[o.worker], hosts.get(o.worker, "?"), r,
                                            cell=run.label)
                    for o, r in zip(outcomes, out) if not r["ok"]]
        if failures:
            remedy = REBUILD_DDP if any(not r.get("group_alive", True) for r in out) else ""
            if not any(f.communication for f in failures):
                hint = ""  # the hint is about collectives; this failure is in the code
            raise DistributedError(failures, what=run.what,
                                   remedy=" ".join(x for x in (hint, remedy) if x))
        return out

    @staticmethod
    def _pump(job: Job, run: Run, view: RunView, healer: Optional[Healer] = None,
              carried: Sequence[Batch] = ()) -> None:
        """Move the batches received so far, and those the results ``carried``, into the run's
        record and onto the screen."""
        batches = [*job.drain_events(), *carried]
        changed = False
        if batches:
            view.output(batches)
            changed = run.feed(batches)
        news = run.stall_news()  # the hang doctor's verdict appeared or changed: show it now
        if changed or news:
            view.refresh(run.snapshot, force=news)
        if healer is not None:
            healer.feed(batches)
            healer.tick()
            for line in healer.new_lines():
                print(line, flush=True)
                run.notes.append(line)

    def _healer(self, job: Job, opts: dict[str, Any]) -> Healer:
        backend, store = self._require(), self._store
        assert store is not None

        def next_generation() -> int:
            self.generation += 1
            return self.generation

        def join_call(w: Any, plan: RankPlan, eplan: Any, key: str, slot: int,
                      seq_base: int) -> Call:
            return Call(w, rt.elastic_join,
                        (plan, self.port, self.options.device, self.options.dist_backend,
                         self.options.timeout, eplan, key, slot, seq_base, False),
                        {"telemetry": opts["telemetry"], "collectives": opts["collectives"],
                         "buckets": opts["buckets"]})

        return Healer(backend, store, self.plans, self._infos, job, replan=self._plan,
                      next_generation=next_generation, join_call=join_call,
                      default_max_failures=self.defaults.elastic_max_failures,
                      timeout=self.options.timeout)

    def _after_elastic(self, healer: Healer, outcomes: list[Any]) -> list[Any]:
        """An elastic run re-formed the group: the job is now its last membership. Calls of
        workers it lost are not failures of the cell (it carried on without them)."""
        final = healer.final()
        assert final is not None
        members = set(final.members)
        self.plans = sorted(final.plans.values(), key=lambda p: p.rank)
        self._infos.update(healer.infos)
        if final.generation is not None:
            self.generation = final.generation
        self.history.reset()  # a new group: the exported script starts after it
        lost = [o for o in outcomes if o.worker not in members and o.engine_error is not None]
        return [o for o in outcomes if o not in lost]

    def _finish(self, job: Job, run: Run, view: RunView,
                healer: Optional[Healer] = None) -> None:
        """Show every batch the finished calls sent (their results say how many), then close.

        The run's record counts what was already drained while the calls ran: a rank that
        finished early may have had its last batch drained before the others returned.
        """
        if run.ended is not None:
            return  # finished already (a timeout or an interrupt shows its view first)
        if not job.pending():
            slot = (healer.slots.get if healer is not None else self._rank_of)
            done = [o.value for o in job.outcomes() if o.engine_error is None]
            wanted = {slot(o.worker): o.value["seq"] for o in job.outcomes()
                      if o.engine_error is None and o.value.get("seq")}

            def drained() -> bool:
                self._pump(job, run, view, healer)
                return run.has_all(wanted)

            # Batches arrive on the engine's IO thread, which offers nothing to wait on (a
            # cell that sent none, only the last batch its result carries, waits for nothing)
            poll_until(drained, _EVENT_GRACE, interval=0.001)
            # then each rank's last batch, after all it sent before it
            self._pump(job, run, view, healer, [r["tail"] for r in done if r.get("tail")])
        else:
            self._pump(job, run, view, healer)
        run.finish()
        view.close(run.snapshot())

    def _rank_of(self, worker: Any) -> int:
        return next(p.rank for p in self.plans if p.worker_id == worker)

    def _interrupt(self, job: Job) -> None:
        backend = self._require()
        backend.interrupt(job.pending())
        if not job.wait(_INTERRUPT_GRACE):
            raise InterruptTimeoutError(sorted(self._rank_of(w) for w in job.pending()),
                                        _INTERRUPT_GRACE)

    # ----------------------------------------------------------------- data
    def push(self, values: dict[str, Any], *, ranks: Optional[str] = None) -> None:
        """Send notebook values to every worker's namespace (``%nbdist push NAME...``)."""
        self._require()
        blob = cloudpickle.dumps(values)
        selected = parse_ranks(ranks, self.world_size)
        self._call([Call(self.plans[r].worker_id, rt.push, (blob,)) for r in selected],
                   self.options.timeout, "push values")
        self.history.push(values, blob, None if len(selected) == self.world_size else selected)

    def pull(self, name: str, *, rank: int = 0) -> Any:
        """Bring ``name`` from rank ``rank`` into the notebook (tensors and modules on CPU)."""
        self._require()
        parse_ranks(str(rank), self.world_size)
        res: results.PullResult
        [res] = self._call([Call(self.plans[rank].worker_id, rt.pull, (name,))],
                           self.options.timeout, f"pull {name!r}")
        if not res["ok"]:
            raise NameError(f"rank {rank}: {res['evalue']}")
        return cloudpickle.loads(res["blob"])

    # ----------------------------------------------------------------- notebook to job
    def export(self, path: str, *, force: bool = False) -> Any:
        """Write the cells that ran successfully since the group formed as a torchrun script.

        Pushed values the cells read go in as code (literals) or in ``<stem>.data.pkl`` next
        to the script. Returns an :class:`~nbdist.export.Export` (its ``command`` is the
        launch line). A file nbdist did not write is not overwritten unless ``force``.
        See ``docs/export.md``.
        """
        from ._version import __version__
        from .export import write

        self._require()
        return write(path, self.history.entries, self.plans, self.options, self.profile_path,
                     version=__version__, force=force)

    def save_profile(self, path: str) -> str:
        """Write this session's options as a profile that ``start(profile=path)`` reads."""
        from .profiles import dump_profile, from_options

        backend = self._require()
        header = f"nbdist profile saved from a session on {backend.describe()}.\n"
        if not backend.owns_cluster:
            header += "That session was connected to its cluster; this starts one like it.\n"
        header += f"Start it with: %nbdist start --profile {os.path.basename(path)}"
        text = dump_profile(from_options(self.options, self.defaults), header)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def dask_client(self) -> Any:
        """A ``distributed.Client`` on these same workers, for Dask-ML, XGBoost, LightGBM.

        The Dask engine's own client; on ipyparallel, the engines become Dask workers too
        (ipyparallel's ``become_dask``). Do not close it: ``nbdist.stop()`` does.
        """
        return self._require().dask_client()

    # ----------------------------------------------------------------- plumbing
    def _require(self) -> Backend:
        if self.backend is None:
            raise NoClusterError()
        return self.backend

    def _submit(self, calls: list[Call]) -> Job:
        """``backend.submit``, refusing at once when a planned worker is known to be gone.

        After the engine failed a call, the next job first asks the engine which workers it
        still has (one round trip, only then): a call to a dead worker would otherwise fail
        with the engine's own error, or, on Dask, wait for the process group's timeout.
        """
        backend = self._require()
        if self._suspect:
            live = set(backend.worker_ids())
            gone = [p for p in self.plans if p.worker_id not in live]
            if gone:
                raise WorkersGone([p.rank for p in gone], [p.hostname for p in gone],
                                  owned=backend.owns_cluster, world_size=self.world_size)
            self._suspect.clear()
        try:
            return backend.submit(calls)
        except WorkerGone as exc:
            lost = [p for p in self.plans if p.worker_id in set(exc.workers)]
            raise WorkersGone([p.rank for p in lost], [p.hostname for p in lost],
                              owned=backend.owns_cluster, world_size=self.world_size) from exc

    def _call(self, calls: list[Call], timeout: float, what: str) -> list[Any]:
        """Run nbdist's own calls (not user code) and return their values, or raise."""
        backend = self._require()
        job = self._submit(calls)
        try:
            ok = job.wait(timeout)
        except KeyboardInterrupt:
            backend.interrupt(job.pending())
            raise
        if not ok:
            raise ClusterError(f"workers {job.pending()} did not {what} within {timeout:g} s")
        outcomes = job.outcomes()
        errors = [o for o in outcomes if o.engine_error is not None]
        if errors:
            detail = "\n".join(f"worker {o.worker}: {o.engine_error}" for o in errors)
            raise ClusterError(f"could not {what}:\n{detail}")
        return [o.value for o in outcomes]

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


class CellName(NamedTuple):
    """How a cell is named: the file in its tracebacks, and ``In [12]`` in error headlines."""

    filename: str
    label: Optional[str]


def cell_name(n: int, execution_count: Optional[int] = None) -> CellName:
    """``<distributed cell [12]>`` / ``In [12]`` where the kernel numbers the cell, else the
    session's own count ``<distributed cell 3>`` and no label."""
    if execution_count is not None:
        return CellName(f"<distributed cell [{execution_count}]>", f"In [{execution_count}]")
    return CellName(f"<distributed cell {n}>", None)


_default: Optional[Session] = None


def default_session() -> Session:
    """The notebook's session, shared by magics, widgets and the module-level API."""
    global _default
    if _default is None:
        _default = Session()
    return _default
