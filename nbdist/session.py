"""The one stateful coordinator. Magics, widgets and Python code all call these methods."""

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
from typing import Any, Optional

import cloudpickle

from .backends import get_backend
from .backends.base import Backend, Call, Job, Outcome
from .display import RunView, make_run_view
from .errors import (
    CellTimeoutError,
    ClusterError,
    DistributedError,
    NbdistError,
    NoClusterError,
    RankFailure,
)
from .options import CellOptions, ClusterOptions, parse_ranks
from .records import ClusterStatus, RemoteValue, WorkerRow
from .runtime import worker as rt
from .runtime.env import RankPlan, plan_ranks, shared_gpus
from .telemetry.aggregate import RunSnapshot
from .telemetry.trace import write_trace

# After an interrupt, how long workers get to return before we call them unresponsive.
_INTERRUPT_GRACE = 15.0
# After a cell ends, how long we wait for its last output batches to arrive.
_EVENT_GRACE = 3.0


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

    def __init__(self) -> None:
        self.backend: Optional[Backend] = None
        self.options = ClusterOptions()
        self.plans: list[RankPlan] = []
        self.generation = 0
        self.port: Optional[int] = None
        self._joined: dict[int, dict[str, Any]] = {}
        self._target: dict[str, Any] = {}
        self._cells = 0
        self._lock = threading.Lock()
        #: telemetry of the latest runs (RunState), newest last; see timeline() and last_run
        self.runs: deque[Any] = deque(maxlen=3)

    # ----------------------------------------------------------------- lifecycle
    def start(self, n: Optional[int] = None, *, engine: str = "ipyparallel",
              device: str = "auto", dist_backend: str = "auto", timeout: float = 300.0,
              threads: Optional[int] = None) -> Session:
        """Start a local cluster of ``n`` workers (default: one per GPU, else 2); form the job."""
        if n is None:
            n = count_local_gpus() or 2
        options = ClusterOptions(engine=engine, n=n, device=device, dist_backend=dist_backend,
                                 timeout=timeout, threads=threads)
        self.stop()
        backend = get_backend(engine)
        backend.start(n, timeout)
        self._adopt(backend, options)
        return self

    def connect(self, *, engine: str = "ipyparallel", device: str = "auto",
                dist_backend: str = "auto", timeout: float = 300.0,
                threads: Optional[int] = None, **target: Any) -> Session:
        """Attach to a running cluster (ipyparallel: ``cluster_id``, ``profile``, ``url_file``)."""
        options = ClusterOptions(engine=engine, device=device, dist_backend=dist_backend,
                                 timeout=timeout, threads=threads)
        self.stop()
        backend = get_backend(engine)
        backend.connect(timeout, **target)
        self._target = target
        self._adopt(backend, options)
        return self

    def _adopt(self, backend: Backend, options: ClusterOptions) -> None:
        self.backend = backend
        self.options = replace(options, n=len(backend.worker_ids()))
        try:
            self._form()
        except BaseException:
            self.stop()
            raise

    def _form(self) -> None:
        """Describe workers, plan ranks by host, open the store on rank 0, join everyone."""
        backend = self._require()
        ids = backend.worker_ids()
        if not ids:
            raise ClusterError("the cluster has no workers")
        timeout = self.options.timeout
        infos = self._call([Call(w, rt.describe, (backend.controller_ip,)) for w in ids],
                           timeout, "describe workers")
        for w, info in zip(ids, infos):
            info["worker_id"] = w
        self.plans = plan_ranks(infos, threads=self.options.threads,
                                use_gpus=self.options.device != "cpu")
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
        rank0 = self.plans[0]
        [self.port] = self._call([Call(rank0.worker_id, rt.open_store,
                                       (rank0.master_addr, "cluster", timeout))],
                                 timeout, "open the rendezvous store")
        self.generation += 1
        joined = self._call(
            [Call(p.worker_id, rt.join, (p, self.port, self.options.device,
                                         self.options.dist_backend, timeout, self.generation))
             for p in self.plans], timeout + 30, "form the process group")
        self._joined = {j["rank"]: j for j in joined}

    def stop(self) -> None:
        """Stop workers nbdist started (or disconnect from a cluster it attached to)."""
        backend, self.backend = self.backend, None
        self.plans, self._joined, self.port = [], {}, None
        if backend is not None:
            backend.stop()

    def restart(self) -> Session:
        """Stop and start again with the same options (fresh processes, empty namespaces)."""
        if self.backend is None:
            raise NoClusterError()
        opts, owned, target = self.options, self.backend.owns_cluster, dict(self._target)
        if owned:
            return self.start(opts.n, engine=opts.engine, device=opts.device,
                              dist_backend=opts.dist_backend, timeout=opts.timeout,
                              threads=opts.threads)
        return self.connect(engine=opts.engine, device=opts.device,
                            dist_backend=opts.dist_backend, timeout=opts.timeout,
                            threads=opts.threads, **target)

    def scale(self, n: int) -> Session:
        """Make the cluster ``n`` workers and re-form the process group at the new size.

        Worker namespaces survive on workers that stay, but models wrapped in
        DistributedDataParallel and optimizers must be rebuilt for the new world size.
        """
        if n < 1:
            raise ValueError(f"cannot scale to {n} workers: at least 1 is needed")
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
                 timeout: Optional[float] = None, output: str = "rank0",
                 telemetry: bool = True, time_collectives: bool = True) -> Optional[RemoteValue]:
        """Run ``code`` on every rank (or ``ranks``, e.g. ``"0,2-3"``) as one job.

        Returns the value of the last expression on the lowest selected rank, for display.
        Raises :class:`~nbdist.errors.DistributedError` naming the failing ranks. With
        ``telemetry`` (default), steps and gradient all-reduces are timed and shown live, and
        so are ``torch.distributed`` collectives called in the cell unless
        ``time_collectives=False``; see ``docs/telemetry.md``.
        """
        opts = CellOptions(ranks=ranks, timeout=timeout, output=output)
        self._require()
        selected = parse_ranks(opts.ranks, self.world_size)
        ast.parse(code, "<cell>", "exec")  # a syntax error is raised here, before shipping
        with self._lock:
            self._cells += 1
            filename = f"<distributed cell {self._cells}>"
        cell_id = uuid.uuid4().hex
        calls = [Call(self.plans[r].worker_id, rt.run_cell,
                      (code, filename, cell_id, self.generation, list(selected), r == selected[0]),
                      {"telemetry": telemetry, "collectives": time_collectives})
                 for r in selected]
        view = make_run_view(opts.output, selected[0], self.world_size, ranks=selected)
        hint = ""
        if len(selected) < self.world_size:
            hint = (f"This cell ran on rank(s) {', '.join(map(str, selected))} only, but "
                    "collectives need every rank of the group; a cell that runs on every rank "
                    "re-forms the group if it was lost.")
        try:
            results = self._run(calls, view, opts.timeout, "cell", hint)
        finally:
            if view.state.recorded:
                self.runs.append(view.state)
        by_rank = dict(zip(selected, results))
        first = by_rank[selected[0]]
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
            raise FileNotFoundError(f"cannot read script {path!r}: {exc.strerror}") from None
        rank0 = self.plans[0]
        [port] = self._call([Call(rank0.worker_id, rt.open_store,
                                  (rank0.master_addr, "run", self.options.timeout))],
                            self.options.timeout, "open the script's rendezvous store")
        try:
            calls = [Call(p.worker_id, rt.run_script,
                          (os.path.abspath(path), source, list(argv), port, os.getcwd()))
                     for p in self.plans]
            self._run(calls, make_run_view(output, 0, self.world_size), timeout,
                      f"script {os.path.basename(path)}")
        finally:
            self._call([Call(rank0.worker_id, rt.close_store, ("run",))], 30, "close store")

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
        state = self.runs[run]
        meta = {"world_size": self.world_size, "dropped_events": state.dropped}
        return write_trace(path, state.events(), meta)

    def _run(self, calls: list[Call], view: RunView, timeout: Optional[float],
             what: str, hint: str = "") -> list[dict]:
        """Submit per-rank calls, stream their output, and turn failures into one error."""
        backend = self._require()
        rank_of = {p.worker_id: p.rank for p in self.plans}
        job = backend.submit(calls)
        start = time.monotonic()
        seen: dict[int, int] = {}  # rank -> highest batch seq received, over the whole run
        try:
            while not job.wait(0.1):
                view.feed(_track(job.drain_events(), seen))
                if timeout is not None and time.monotonic() - start > timeout:
                    late = sorted(rank_of[w] for w in job.pending())
                    self._interrupt(job)
                    self.generation += 1
                    raise CellTimeoutError(timeout, late, hint)
        except KeyboardInterrupt:
            self._interrupt(job)
            self.generation += 1
            raise
        finally:
            self._finish_events(job, view, seen)
        outcomes = job.outcomes()
        results = [self._result(o, rank_of[o.worker]) for o in outcomes]
        if any(not r.get("group_alive", True) for r in results):
            self.generation += 1  # the next full cell re-forms the group
        failures = [self._failure(r, rank_of[o.worker]) for o, r in zip(outcomes, results)
                    if not r.get("ok")]
        if failures:
            remedy = ("The process group is re-formed for the next cell; re-create "
                      "DistributedDataParallel wrappers made before this cell." if any(
                          not r.get("group_alive", True) for r in results) else "")
            if not any(f.communication for f in failures):
                hint = ""  # the hint is about collectives; this failure is in the code
            raise DistributedError(failures, what=what,
                                   remedy=" ".join(x for x in (hint, remedy) if x))
        return results

    def _finish_events(self, job: Job, view: RunView, seen: dict[int, int]) -> None:
        """Show every batch the finished calls sent (their results say how many).

        ``seen`` holds what was already drained while the calls ran: a rank that finished
        early may have had its last batch drained before the others returned.
        """
        if job.pending():
            view.feed(job.drain_events())
            view.close()
            return
        want = {}
        for o in job.outcomes():
            if o.engine_error is None and isinstance(o.value, dict) and o.value.get("seq"):
                want[self._rank_of(o.worker)] = o.value["seq"]
        deadline = time.monotonic() + _EVENT_GRACE
        waiter = threading.Event()
        while True:
            view.feed(_track(job.drain_events(), seen))
            if all(seen.get(r, 0) >= s for r, s in want.items()) or time.monotonic() > deadline:
                break
            waiter.wait(0.01)  # batches arrive on the engine's IO thread
        view.close()

    def _rank_of(self, worker: Any) -> int:
        return next(p.rank for p in self.plans if p.worker_id == worker)

    def _result(self, outcome: Outcome, rank: int) -> dict:
        if outcome.engine_error is not None:
            return {"ok": False, "error": {"ename": "WorkerError", "evalue":
                    outcome.engine_error.splitlines()[0], "traceback": outcome.engine_error},
                    "group_alive": False}
        return outcome.value

    def _failure(self, result: dict, rank: int) -> RankFailure:
        plan = self.plans[rank]
        err = result.get("error")
        if err is None:  # a script's non-zero exit
            code = result.get("returncode")
            msg = "interrupted" if result.get("interrupted") else f"exited with status {code}"
            return RankFailure(rank, plan.hostname, "ScriptError", msg)
        return RankFailure(rank, plan.hostname, err["ename"], err["evalue"],
                           err.get("traceback", ""), err.get("line"))

    def _interrupt(self, job: Job) -> None:
        backend = self._require()
        backend.interrupt(job.pending())
        if not job.wait(_INTERRUPT_GRACE):
            ranks = sorted(self._rank_of(w) for w in job.pending())
            raise ClusterError(
                f"rank(s) {ranks} did not stop after an interrupt within {_INTERRUPT_GRACE:g} s "
                "(stuck in native code?). Run %nbdist restart to get fresh workers.")

    # ----------------------------------------------------------------- data
    def push(self, values: dict[str, Any], *, ranks: Optional[str] = None) -> None:
        """Send notebook values to every worker's namespace (``%nbdist push NAME...``)."""
        self._require()
        blob = cloudpickle.dumps(values)
        selected = parse_ranks(ranks, self.world_size)
        self._call([Call(self.plans[r].worker_id, rt.push, (blob,)) for r in selected],
                   self.options.timeout, "push values")

    def pull(self, name: str, *, rank: int = 0) -> Any:
        """Bring ``name`` from rank ``rank`` into the notebook (tensors and modules on CPU)."""
        self._require()
        parse_ranks(str(rank), self.world_size)
        [res] = self._call([Call(self.plans[rank].worker_id, rt.pull, (name,))],
                           self.options.timeout, f"pull {name!r}")
        if not res["ok"]:
            raise NameError(f"rank {rank}: {res['evalue']}")
        return cloudpickle.loads(res["blob"])

    # ----------------------------------------------------------------- plumbing
    def _require(self) -> Backend:
        if self.backend is None:
            raise NoClusterError()
        return self.backend

    def _call(self, calls: list[Call], timeout: float, what: str) -> list[Any]:
        """Run nbdist's own calls (not user code) and return their values, or raise."""
        job = self._require().submit(calls)
        try:
            ok = job.wait(timeout)
        except KeyboardInterrupt:
            self._require().interrupt(job.pending())
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


def _track(batches: list, seen: dict[int, int]) -> list:
    """Record the highest batch sequence number per rank in ``seen``; return ``batches``."""
    for b in batches:
        seen[b["rank"]] = max(seen.get(b["rank"], 0), b["seq"])
    return batches


_default: Optional[Session] = None


def default_session() -> Session:
    """The notebook's session, shared by magics, widgets and the module-level API."""
    global _default
    if _default is None:
        _default = Session()
    return _default
