"""The facade that magics, widgets and Python code all call.

A Session is a :class:`~nbdist.group.cluster.Cluster` (the workers and the process group on
them: start, connect, scale, stop, status, through the job's
:class:`~nbdist.group.membership.Membership`) that runs cells on it: each cell is prepared and
kept by :class:`~nbdist.cell.runner.Cells` and run as a :class:`~nbdist.cell.loop.CellRun` (the
cell loop). Beside the cells it owns what moves data (:mod:`nbdist.group.transfer`), what
``--tune`` chose (:mod:`nbdist.tuning`), the faults due in the next cell
(:mod:`nbdist.debugger.faults`) and the record ``export`` writes (:mod:`nbdist.exporter`).

Commands flow down (Session → backend → worker runtime); results and events flow back up:
the cell run turns results into errors and feeds events into the run's record
(:class:`~nbdist.telemetry.run.Run`), whose snapshots the views draw.
"""

from __future__ import annotations

import ast
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Optional

from .backends import get_backend
from .backends.base import Backend
from .boot.store_host import StoreHost
from .cell.runner import KEPT_RUNS, MAX_NAMED, Cells
from .debugger.console import for_call, post_mortem
from .debugger.faults import Faults
from .display import end_cluster_views, make_run_view, make_start_view
from .exporter.history import History
from .group.cluster import Cluster
from .group.transfer import Transfers
from .options import CellOptions, ClusterOptions, parse_ranks
from .records import ClusterStatus, Comparison, Held, RemoteValue, TuneResult
from .runtime.measure.spec import DDPSettings
from .telemetry.run import Run
from .telemetry.snapshot import RunSnapshot
from .tuning import DEFAULT_STEPS, Tuning


class Session(Cluster):
    """A data-parallel job on warm workers: start or connect, then run cells on every rank.

    Examples
    --------
    >>> s = Session().start(n=2)                       # doctest: +SKIP
    >>> s.run_cell("import torch.distributed as dist; dist.get_world_size()")  # doctest: +SKIP
    2
    """

    def __init__(self, backends: Callable[[str], Backend] = get_backend,
                 stores: Optional[Callable[[str, float], StoreHost]] = StoreHost) -> None:
        super().__init__(backends, stores, make_start_view)
        #: the cells and pushes since the process group formed, for :meth:`export`
        self.history = History()
        #: pushes and pulls, and their data channel (:mod:`nbdist.group.transfer`)
        self.transfers = Transfers()
        #: what ``%%distributed --tune`` chose, applied to DDP models built in later cells
        self.tuning = Tuning()
        #: faults asked for on purpose (``%nbdist kill --after``), due in the next cell
        self.faults = Faults()
        #: the cells: their numbers, calls and runs (:mod:`nbdist.cell.runner`)
        self.cells = Cells(self.membership, self.history, self.tuning, self.faults,
                           lambda: self.defaults, make_run_view, for_call)
        #: records of the latest runs that recorded telemetry, newest last
        self.runs: deque[Run] = self.cells.runs
        #: every run labelled with ``name=`` (``%%distributed --name``), kept for compare()
        self.named: dict[str, Run] = self.cells.named

    def _form(self, options: ClusterOptions) -> None:
        super()._form(options)
        self.history.reset()  # a new group: what ran before is not this job's script

    def stop(self) -> Optional[str]:
        self.transfers.close()
        said = super().stop()
        self.release()
        end_cluster_views()  # the panels shown say so, and stay in the notebook as text
        return said

    def release(self) -> None:
        """Let go of what the session keeps across cells: the export record and its push
        copies, the kept runs and named runs (``stop`` does it; ``docs/limits.md``)."""
        self.history.reset()
        self.cells.release()

    def held(self) -> Held:
        """What the notebook keeps across cells, each store with its bound (the last line of
        ``%nbdist status``; ``docs/limits.md``, "What the notebook keeps")."""
        h = self.history
        runs, named, events = self.cells.held()
        return Held(cells=len(h.cells), max_cells=h.max_cells,
                    pushes=len(h.entries) - len(h.cells), push_bytes=h.kept_bytes,
                    push_budget=h.budget, runs=runs, max_runs=KEPT_RUNS, named=named,
                    max_named=MAX_NAMED, trace_events=events)

    def status(self) -> ClusterStatus:
        """One row per worker: rank, host, pid, device, alive, memory (a worker that does
        not answer within 10 s is shown busy, or gone); then what the notebook holds
        (:meth:`held`).

        Raises
        ------
        NoClusterError
            No job is running.
        """
        return replace(super().status(), held=self.held())

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
        return self.cells.run(code, opts, measure, first_line, execution_count)[0]

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
            partial(self.cells.run, code, first_line=first_line,
                    execution_count=execution_count, trial=True), self.named, self.defaults, steps,
            timeout, time_collectives, bucket_timing, stall_after)
        joined = next(iter(self.membership.joined.values()), {"backend": "gloo"})
        result = self.tuning.tune(trial, steps, joined["backend"], timeout=limit,
                                  say=(lambda line: None) if quiet else print)
        self.history.cell(self.cells.count, code, None)
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
        self.cells.run_script(path, argv, timeout, output)

    @property
    def last_run(self) -> Optional[RunSnapshot]:
        """Summary of the latest run that recorded telemetry (None before any)."""
        return self.cells.last()

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
        return self.cells.trace(path, run)

    def compare(self, *names: str) -> Comparison:
        """Named runs side by side (all of them, or ``names`` in that order).

        Raises
        ------
        NbdistError
            No run has a name yet.
        OptionError
            A name in ``names`` labels no run (the message lists those that do).
        """
        return self.cells.compare(names)

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
        to the script. Returns an :class:`~nbdist.exporter.torchrun.Export` (its ``command``
        is the launch line; its ``attach`` the ``NBDIST_ATTACH=...`` line that makes the
        launched job report to this notebook, where ``%nbdist attach`` runs a collector). A
        file nbdist did not write is not overwritten unless ``force``. See ``docs/export.md``.

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
        from .watch.collector import current, hook_installed

        options = replace(self.options, dist_backend=m.dist_backend)  # gloo on shared GPUs
        out = write(path, self.history.entries, self.plans, options, self.profile_path,
                    version=__version__, force=force, forgotten=self.history.forgotten)
        collector = current()  # the script, launched with its line, reports to this notebook
        if collector is None:
            return out
        return replace(out, attach=collector.line, agent=not hook_installed())

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


_default: Optional[Session] = None


def default_session() -> Session:
    """The notebook's session, shared by magics, widgets and the module-level API."""
    global _default
    if _default is None:
        _default = Session()
    return _default
