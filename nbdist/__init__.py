"""nbdist: run a notebook cell as a torch.distributed data-parallel job on warm workers.

In Jupyter::

    %load_ext nbdist
    %nbdist start -n 2

    %%distributed
    import torch.distributed as dist
    print(rank, world_size, device)

The same from Python: ``nbdist.start(2)``, ``nbdist.run_cell(code)``, ``nbdist.pull("model")``.
Importing this package is cheap: torch, widgets and engines load on first use.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

from ._extension import load_ipython_extension, unload_ipython_extension
from ._version import __version__

if TYPE_CHECKING:
    from .exporter.torchrun import Export
    from .profiles import Profile
    from .records import ClusterStatus, RemoteValue
    from .runtime.measure.spec import DDPSettings
    from .session import Session

__all__ = [
    "start", "connect", "stop", "restart", "scale", "status", "run_cell", "run_script", "push",
    "pull", "current_session", "load_ipython_extension", "unload_ipython_extension", "__version__",
    "progress", "log", "export", "save_profile", "load_profile", "dask_client", "mesh",
    "compare", "auto", "ParameterServer", "elastic", "tune", "tune_settings", "tune_reset",
    "debug", "kill", "hang", "DebuggerQuit", "attach", "jobs", "job",
]


def __dir__() -> list[str]:
    """The public names, those loaded on first use included (what tab completion offers),
    not the typing names this module imports for itself."""
    return sorted(__all__)


def __getattr__(name: str) -> Any:
    # progress/log live in the worker runtime; loaded on first use to keep `import nbdist` cheap.
    if name in ("progress", "log"):
        import importlib

        return getattr(importlib.import_module(".runtime.progress", __name__), name)
    if name == "mesh":
        from .runtime.mesh import mesh

        return mesh
    if name == "elastic":  # worker-side, needs torch
        import importlib

        return importlib.import_module(".elastic", __name__)
    if name == "DebuggerQuit":
        from .errors import DebuggerQuit

        return DebuggerQuit
    if name == "ParameterServer":  # worker-side, needs torch
        from .runtime.parameter_server import ParameterServer

        return ParameterServer
    raise AttributeError(f"module 'nbdist' has no attribute {name!r}")


def current_session() -> Session:
    """The notebook's shared :class:`~nbdist.session.Session` (magics use the same one)."""
    from .session import default_session

    return default_session()


def start(n: Optional[int] = None, *, profile: Any = None, **options: Any) -> Session:
    """Start ``n`` workers, on this machine or as the ``profile`` file describes (the other
    ``options`` override it); see :meth:`Session.start`.

    Raises
    ------
    ProfileError
        The profile is missing, not YAML, or not valid.
    OptionError
        A bad option value or combination.
    ImportError
        The engine's or the launcher's package is not installed.
    ClusterError
        The workers did not start within ``timeout`` seconds, or the job could not be formed.
    RuntimeError
        The notebook's rendezvous store process failed.
    """
    return current_session().start(n, profile=profile, **options)


def connect(**options: Any) -> Session:
    """Attach to an existing cluster; see :meth:`Session.connect`.

    Raises
    ------
    OptionError
        A bad option value, an unknown engine, or a target the engine cannot use.
    ImportError
        The engine's package is not installed.
    ClusterError
        The cluster cannot be reached or has no workers, or the job could not be formed.
    RuntimeError
        The notebook's rendezvous store process failed.
    """
    return current_session().connect(**options)


def stop() -> Optional[str]:
    """Stop the workers nbdist started (or disconnect); returns what was stopped, in words.

    Raises
    ------
    Exception
        The engine's own error when a cluster nbdist started fails to stop.
    """
    return current_session().stop()


def restart() -> Session:
    """Fresh workers with the same options (:meth:`Session.restart`).

    Raises
    ------
    NoClusterError
        No job is running.
    ClusterError, ImportError, OptionError, RuntimeError
        As for :func:`start`: the workers did not come back, or the job could not be formed.
    """
    return current_session().restart()


def scale(n: int) -> Session:
    """Resize the cluster to ``n`` workers (``n``: the new world size, not a number to add)
    and re-form the process group. The highest ranks leave; workers that stay keep their
    ranks; new workers take the ranks of workers that left, then the next ones
    (:meth:`Session.scale`).

    Raises
    ------
    OptionError
        ``n`` is less than 1.
    NoClusterError
        No job is running.
    ClusterError
        nbdist did not start this cluster, or it did not reach ``n`` workers in time.
    """
    return current_session().scale(n)


def status() -> ClusterStatus:
    """Workers with rank, host, pid, device and liveness.

    Raises
    ------
    NoClusterError
        No job is running.
    """
    return current_session().status()


def run_cell(code: str, **options: Any) -> Optional[RemoteValue]:
    """Run ``code`` on every rank, like a ``%%distributed`` cell; ``options`` are
    :meth:`Session.run_cell`'s (``timeout`` in seconds).

    Raises
    ------
    OptionError
        A bad option value (``ranks`` outside the job, ``timeout`` not positive).
    NoClusterError
        No job is running.
    SyntaxError
        ``code`` does not parse; raised before anything is sent.
    DistributedError
        The cell raised on one or more ranks (the error names each, with its traceback).
    CellTimeoutError
        The cell ran past ``timeout`` seconds and was interrupted on every rank.
    RanksFinishedError
        Ranks finished the cell while others waited in a collective they will never call
        (uneven inputs); the waiting ranks were interrupted about 2 s after the last finished.
    CellInterrupted
        The kernel was interrupted (a ``KeyboardInterrupt``).
    ClusterError
        A rank's worker is gone, or ranks an interrupt could not stop in time.
    """
    return current_session().run_cell(code, **options)


def run_script(path: str, argv: Sequence[str] = (), **options: Any) -> None:
    """Run a torchrun-style script on every rank (``%nbdist run``); ``options`` are
    :meth:`Session.run_script`'s (``timeout`` in seconds).

    Raises
    ------
    NoClusterError
        No job is running.
    FileNotFoundError
        The script cannot be read.
    DistributedError
        The script failed on one or more ranks.
    CellTimeoutError, CellInterrupted
        It ran past ``timeout`` seconds, or the kernel was interrupted.
    ClusterError
        A rank's worker is gone, or the script's rendezvous store could not be opened.
    RuntimeError
        The notebook's rendezvous store process failed.
    """
    current_session().run_script(path, argv, **options)


def push(*args: dict[str, Any], **values: Any) -> None:
    """Send values to every worker: ``nbdist.push(lr=0.1)`` or ``nbdist.push({"lr": 0.1})``.

    Raises
    ------
    NoClusterError
        No job is running.
    TypeError, pickle.PicklingError
        A value cannot be pickled.
    ClusterError
        A worker is gone, or the push failed there or did not end within the cluster's
        ``timeout`` seconds.
    """
    merged: dict[str, Any] = {}
    for d in args:
        merged.update(d)
    merged.update(values)
    current_session().push(merged)


def pull(name: str, rank: int = 0) -> Any:
    """Bring a worker variable into the notebook, tensors and modules moved to CPU.

    Raises
    ------
    NoClusterError
        No job is running.
    OptionError
        ``rank`` is not a rank of the job.
    NameError
        The rank has no such name, or the value is over 2 GiB or cannot be pickled.
    ClusterError
        The rank's worker is gone, or the pull failed or did not end in time.
    TimeoutError
        Its large buffers did not arrive over the data channel in time.
    """
    return current_session().pull(name, rank=rank)


def export(path: str, force: bool = False) -> Export:
    """Write the cells since the process group formed as a torchrun script (``%nbdist export``).

    >>> nbdist.export("train.py").command       # doctest: +SKIP
    'torchrun --nproc_per_node=2 train.py'

    Raises
    ------
    NoClusterError
        No job is running.
    ExportError
        No cell ran successfully since the group formed, or ``path`` is a file nbdist did not
        write (and not ``force``).
    OSError
        The files cannot be written.
    """
    return current_session().export(path, force=force)


def save_profile(path: str) -> str:
    """Write the running session's options as a profile (``%nbdist profile save``).

    Raises
    ------
    NoClusterError
        No job is running.
    OSError
        The file cannot be written.
    """
    return current_session().save_profile(path)


def load_profile(path: str) -> Profile:
    """Read and validate a profile file; errors name the line and key (``profile check``).

    Raises
    ------
    ProfileError
        The file is missing or unreadable, not YAML, or not a valid profile.
    """
    import importlib  # the module's function, not this twin of the same name

    return importlib.import_module(".profiles", __name__).load_profile(path)


def dask_client() -> Any:
    """A ``distributed.Client`` on the session's workers, for Dask-ML, XGBoost or LightGBM.

    Raises
    ------
    NoClusterError
        No job is running.
    MissingPackageError
        On ipyparallel, Dask's ``distributed`` package is not installed.
    ClusterError
        The engine cannot serve Dask work.
    """
    return current_session().dask_client()


def compare(*names: str) -> Any:
    """Named runs side by side (``%%distributed --name LABEL``): a pandas DataFrame of
    samples/s, step time, exposed communication, a pipeline's bubble, bytes per step, memory
    per rank and the last logged values, one row per run (all named runs, or ``names``).
    Without pandas, a :class:`~nbdist.records.Comparison`, which shows itself as an HTML table
    and chart.

    Raises
    ------
    NbdistError
        No run has a name yet.
    OptionError
        A name in ``names`` labels no run.
    """
    comparison = current_session().compare(*names)
    try:
        return comparison.to_pandas()
    except ImportError:
        return comparison


def debug(rank: Optional[int] = None) -> int:
    """Post-mortem pdb on the frame where the last cell failed on ``rank`` (default: the
    first rank that failed), answered in the notebook's input box (``%nbdist debug``).
    Returns the rank. See ``docs/debugging.md``.

    Raises
    ------
    NoClusterError
        No job is running.
    OptionError
        ``rank`` is not a rank of the job.
    DebuggerUnavailable
        No one can answer the debugger here (the message says why).
    NothingToDebug
        No rank's last cell failed, or ``rank``'s did not.
    DistributedError
        The debugger itself failed on the rank.
    ClusterError
        A rank's worker is gone.
    """
    return current_session().debug(rank)


def kill(rank: int, signal: str = "SIGKILL", after: Optional[float] = None) -> str:
    """Kill ``rank``'s worker process from outside, as a real failure (``%nbdist kill``):
    now, or ``after`` seconds into the next cell. Returns what was done, in words.

    Raises
    ------
    NoClusterError
        No job is running.
    OptionError
        ``rank`` is not a rank of the job, ``signal`` names no signal, or ``after`` < 0.
    ClusterError
        The engine cannot signal the worker.
    """
    return current_session().kill(rank, signal, after=after)


def hang(rank: int, seconds: float = 60.0) -> str:
    """Make ``rank`` hold for ``seconds`` at its next collective, as a hung rank would
    (``%nbdist hang``). Returns what was done, in words.

    Raises
    ------
    NoClusterError
        No job is running.
    OptionError
        ``rank`` is not a rank of the job, or ``seconds`` is not more than 0.
    ClusterError
        The rank's worker is gone or did not answer.
    """
    return current_session().hang(rank, seconds)


def tune(code: str, steps: int = 20, **options: Any) -> Any:
    """Run ``code`` as tuning trials, ``steps`` optimizer steps each (``%%distributed --tune
    STEPS``): one trial per DDP setting (bucket sizes, bucket views, static graph,
    compression), successive halving, and the fastest exact setting becomes the default for
    DDP models built later. Returns the trials as a pandas DataFrame, fastest first (without
    pandas, a :class:`~nbdist.records.TuneResult`); see :meth:`Session.tune` for ``options``.

    >>> nbdist.tune(open("train_cell.py").read(), steps=10)   # doctest: +SKIP

    Raises
    ------
    OptionError
        Fewer ``steps`` than a trial needs, or a bad option value.
    NoClusterError
        No job is running.
    SyntaxError
        ``code`` does not parse.
    TuneError
        The cell builds no DDP model, or ends before ``steps`` steps; nothing changes.
    DistributedError, CellTimeoutError
        The cell fails (or runs past its ``timeout`` seconds) with torch's defaults.
    """
    result = current_session().tune(code, steps, **options)
    try:
        return result.to_pandas()
    except ImportError:
        return result


def tune_settings() -> DDPSettings:
    """The DDP setting models built from now on get (``%nbdist tune show``): the one
    ``tune`` chose, else the profile's ``training.ddp``; empty: torch's defaults."""
    return current_session().tune_settings()


def tune_reset() -> str:
    """Drop the setting ``tune`` chose (``%nbdist tune reset``); says what applies again."""
    return current_session().tune_reset()


def auto(on: bool = True) -> None:
    """Auto mode (``%nbdist auto on|off``): while on, every cell runs on the ranks.

    Cells that start with a magic, and ``%%local`` cells, stay in the kernel. Needs IPython
    (a notebook or ``ipython``) with a cluster running for ``on``.

    Raises
    ------
    RuntimeError
        Called on a rank (in a cell auto mode sent there), or outside IPython.
    UsageError
        ``on`` with no cluster running (IPython's, as the magic's usage errors are).
    """
    worker = sys.modules.get("nbdist.runtime.worker")
    if worker is not None and worker.current().plan is not None:
        from .errors import AUTO_ON_A_RANK

        raise RuntimeError(AUTO_ON_A_RANK)  # an engine's own IPython must not switch modes
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("nbdist.auto() needs IPython: it changes how notebook cells run")
    if "nbdist" not in shell.magics_manager.magics["line"]:
        load_ipython_extension(shell)
    shell.run_line_magic("nbdist", f"auto {'on' if on else 'off'}")


def attach(listen: Optional[str] = None, token_file: Optional[str] = None,
           tls_cert: Optional[str] = None, tls_key: Optional[str] = None) -> Any:
    """Watch jobs started outside the notebook (``%nbdist attach``): start the kernel's
    collector, or keep the running one, and return it; its ``line`` is what a job's
    environment needs, ``NBDIST_ATTACH=tcp://HOST:PORT/TOKEN`` (its repr says how to launch).

    Parameters
    ----------
    listen : str, optional
        ``[HOST:]PORT`` to listen on; default loopback (``127.0.0.1``) and a free port, so only
        jobs on this machine reach it. Name another interface to watch other hosts' jobs.
    token_file : str, optional
        A file (mode 0600) that keeps the line: given again after a kernel restart, the
        collector listens on the same address with the same token and the running jobs
        report again. Written if missing.
    tls_cert : str, optional
        A certificate file (PEM): connections are TLS and the line says ``tls://``. Both
        files are checked before anything listens. With a collector already running,
        naming no files keeps it as it is (TLS or not); files other than its own, or TLS
        asked of a plain one, are refused, never ignored.
    tls_key : str, optional
        Its key file (PEM, unencrypted); given with ``tls_cert`` only.

    Raises
    ------
    ValueError
        An :class:`~nbdist.errors.AttachError`: a bad ``listen``, half a TLS pair, a TLS
        file that is missing, unreadable or not PEM (or a key not the certificate's), a
        token file that is a directory or others may read, or a collector that already
        listens elsewhere or with other TLS settings (close it first:
        ``nbdist.attach().close()``, with its TLS files if it has them).
    OSError
        The address cannot be listened on.
    """
    from .watch.collector import attach as start_collector

    return start_collector(listen, token_file, tls_cert, tls_key)


def jobs() -> list[Any]:
    """The jobs watched since ``attach`` (``%nbdist jobs``): records with ``id``,
    ``world_size``, ``hosts``, ``state`` (``running``, ``finished``, ``failed`` or ``lost``),
    ``steps`` ({rank: optimizer steps seen}), ``started`` (seconds since the epoch),
    ``dropped`` (event batches lost on the way), ``error``, ``restarts`` and ``stall`` (the
    hang doctor's verdict while the job makes no progress, naming the script's lines, e.g.
    ``train.py:27``; None: none); empty before ``attach``."""
    from .watch.collector import current

    collector = current()
    return collector.jobs.records() if collector is not None else []


def job(ident: Any) -> Any:
    """A handle on one watched job by its ``id`` (or key) (``%nbdist job ID ...``):
    ``stacks()`` ({rank: Python stack now}), ``show()``, ``summary()``, ``snapshot()``,
    ``record``, ``detach()``.

    Raises
    ------
    LookupError
        No job has that id; the message lists the ones there are, says whether it was
        detached, and with none watched gives the line a job needs.
    """
    from .watch.collector import current, missing_job
    from .watch.watched import WatchedJob

    collector = current()
    found = collector.jobs.get(str(ident)) if collector is not None else None
    if found is None:
        raise LookupError(missing_job(ident, "nbdist.attach()"))
    return WatchedJob(collector.jobs, found, collector.stacks, collector.detach)
