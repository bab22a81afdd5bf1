"""Dask's launchers: the cluster class of distributed, dask-jobqueue or dask-kubernetes (or
nbdist's own SSH cluster) for a profile, with its arguments (:func:`cluster_spec`), and the
setting every Dask worker nbdist spawns is started under (:func:`worker_process_config`), under
the rules every launcher keeps (:mod:`nbdist.backends.launchers`). Nothing is started here; the
adapter and :mod:`.elsewhere` start what these describe.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import shlex
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Optional

from ...errors import ClusterError, MissingPackageError, UnguardedScriptError
from ...options import LaunchOptions
from ...runtime.boot import lifeline, route
from ..launchers import bind_host, is_loopback, merged

if TYPE_CHECKING:
    import dask

_JOBQUEUE = {"slurm": "SLURMCluster", "pbs": "PBSCluster", "sge": "SGECluster",
             "lsf": "LSFCluster"}
#: how long a Dask worker elsewhere tries to reach its scheduler before it exits (at its
#: start, e.g. a batch job that left the queue after the notebook was gone)
DEATH_TIMEOUT = 60


def cluster_spec(launch: LaunchOptions, n: int, tag: str = "nbdist",
                 cluster_dir: Optional[str] = None
                 ) -> tuple[str, str, str, dict[str, Any], bool]:
    """The Dask cluster class for ``launch`` and its arguments.

    Returns ``(module, class name, package that provides it, keyword arguments, whether the
    cluster must then be scaled to n)``: nbdist's SSH cluster for ``ssh`` (the scheduler in
    this process, workers over SSH: :mod:`.ssh`), dask-jobqueue's
    ``SLURMCluster``/``PBSCluster``/``SGECluster``/``LSFCluster`` (one worker process per job,
    its output in ``cluster_dir``), dask-kubernetes' ``KubeCluster``. The profile's
    ``resources.options`` are the class's own keyword arguments, merged into nbdist's.
    """
    kwargs: dict[str, Any]
    host = bind_host(launch.listen)
    scheduler = {"host": host, "dashboard_address": f"{host}:0"}
    if launch.launcher == "ssh":
        kwargs = {"hosts": dict(launch.hosts), "listen": launch.listen,
                  "scheduler_options": scheduler,
                  "worker_options": {"nthreads": 1, "death_timeout": DEATH_TIMEOUT,
                                     "preload": [lifeline.__name__]}}
        spec = ("nbdist.backends.dask.ssh", "SSHWorkers", "asyncssh", kwargs, False)
    elif launch.launcher in _JOBQUEUE:
        kwargs = {"processes": 1, "scheduler_options": scheduler,
                  "death_timeout": DEATH_TIMEOUT,
                  "job_script_prologue": [f"export {k}={shlex.quote(v)}"
                                          for k, v in worker_environment().items()]}
        for key, arg in (("cpus", "cores"), ("memory", "memory"), ("queue", "queue"),
                         ("account", "account"), ("walltime", "walltime")):
            if getattr(launch, key):
                kwargs[arg] = getattr(launch, key)
        if launch.gpus and launch.launcher == "slurm":
            kwargs["job_extra_directives"] = [f"--gres=gpu:{launch.gpus}"]
        if cluster_dir:
            kwargs["log_directory"] = cluster_dir
        interface = "interface" in launch.options  # Dask refuses a host beside it
        kwargs["worker_extra_args"] = jobqueue_worker_args(launch.listen, interface)
        if interface:
            del scheduler["host"]
        spec = ("dask_jobqueue", _JOBQUEUE[launch.launcher], "dask-jobqueue", kwargs, True)
    elif launch.launcher == "kubernetes":
        kwargs = {"name": tag, "n_workers": n}
        if launch.image:
            kwargs["image"] = launch.image
        limits = {k: str(v) for k, v in (("cpu", launch.cpus), ("memory", launch.memory),
                                         ("nvidia.com/gpu", launch.gpus)) if v}
        if limits:
            kwargs["resources"] = {"limits": limits, "requests": dict(limits)}
        spec = ("dask_kubernetes.operator", "KubeCluster", "dask-kubernetes", kwargs, False)
    else:
        raise ClusterError(f"the dask engine has no {launch.launcher!r} launcher")
    return (*spec[:3], merged(spec[3], launch.options), spec[4])


def jobqueue_worker_args(listen: Optional[str], interface: bool = False) -> list[str]:
    """What each batch job's worker (and its nanny) binds: loopback with a loopback
    ``listen``, every interface with ``"*"``, otherwise the job's own address on the route to
    ``listen`` (found by the job script when it runs, on its node); where the profile names
    an ``interface``, that."""
    ends = ["--preload", lifeline.__name__]  # a cell that keeps the worker busy ends with it
    if listen == "*" or interface:
        return ends
    if is_loopback(listen):
        host = bind_host(listen)
    else:
        host = f"$({sys.executable} -m {route.__name__} {listen})"
    return ["--host", host, "--dashboard-address", f"{host}:0", *ends]


def import_cluster_class(module: str, name: str, package: str, launcher: str) -> Any:
    """The cluster class, imported now; a missing package is named with how to install it."""
    what = f"the dask engine's {launcher!r} launcher"
    # The SSH cluster imports without asyncssh and fails only once it connects.
    needed = "asyncssh" if package == "asyncssh" else module.split(".")[0]
    if importlib.util.find_spec(needed) is None:
        raise MissingPackageError(what, package, extra=_EXTRAS.get(launcher))
    # dask_jobqueue.runner replaces SIGINT's handler with sys.exit when imported: in a
    # kernel, Jupyter's stop button would then raise SystemExit instead of interrupting.
    sigint = _sigint_handler()
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise MissingPackageError(what, package, extra=_EXTRAS.get(launcher)) from exc
    finally:
        if sigint is not None:
            signal.signal(signal.SIGINT, sigint)


def _sigint_handler() -> Any:
    """SIGINT's handler now, when this thread may set it again; else None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.getsignal(signal.SIGINT)


#: the extra of nbdist that installs each launcher's package for the Dask engine
_EXTRAS = {"ssh": "ssh", "slurm": "slurm", "pbs": "jobqueue", "sge": "jobqueue",
           "lsf": "jobqueue", "kubernetes": "kubernetes"}


def refuse_unguarded_script() -> None:
    """Refuse to spawn Dask workers from the top level of a script without a main guard.

    Workers started with ``spawn`` or ``forkserver`` (Dask's default is spawn) import the
    ``__main__`` script again, so an unguarded call would run once more in every worker, which
    may not start processes while it is being imported: the workers die, and Dask only says
    that its nanny failed to start. A notebook, a shell or a guarded call pass.
    """
    from distributed.utils import get_mp_context  # the dask engine's extra

    where = unguarded_main_call() if get_mp_context().get_start_method() != "fork" else None
    if where is not None:
        raise UnguardedScriptError(*where)


def unguarded_main_call() -> Optional[tuple[str, int]]:
    """(script, line) of the top-level statement of the running ``__main__`` script that led
    here, unless it is an ``if __name__ == "__main__":`` block; None where the caller is not a
    script's top level (a notebook's cell, a shell, ``python -c``) or its source is unreadable.
    """
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and path
                                     and os.path.abspath(frame.f_code.co_filename)
                                     == os.path.abspath(path)):
        frame = frame.f_back
    if frame is None or path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if node.lineno <= frame.f_lineno <= (node.end_lineno or node.lineno):
            return None if _is_main_guard(node) else (path, node.lineno)
    return None


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` (either side, and within an ``and``)."""
    if not isinstance(node, ast.If):
        return False
    return any(isinstance(n, ast.Compare) and {"__name__", "__main__"} <= {
        getattr(e, "id", None) or getattr(e, "value", None) for e in [n.left, *n.comparators]}
        for n in ast.walk(node.test))


#: glibc's setting that Dask's nannies give their workers (see worker_process_config)
MALLOC_TRIM = "MALLOC_TRIM_THRESHOLD_"


def worker_settings() -> dict[str, Any]:
    """Dask settings of every worker nbdist starts, here or elsewhere (see
    :func:`worker_process_config`)."""
    import dask  # the dask engine's extra: imported by the engine that needs it

    environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {})
    environ[MALLOC_TRIM] = None  # None unsets it (a key left out would be merged back in)
    return {"distributed.worker.daemon": False,
            "distributed.worker.profile.enabled": False,
            "distributed.nanny.pre-spawn-environ": environ}


def worker_environment() -> dict[str, str]:
    """:func:`worker_settings` as Dask reads them from the environment (Python literals), for
    batch jobs, which get no configuration of this process."""
    return {"DASK_" + key.upper().replace(".", "__").replace("-", "_"): repr(value)
            for key, value in worker_settings().items()}


def worker_process_config(local: bool = True) -> dask.config.set:
    """Config for the worker processes nbdist spawns; the nanny reads it when it spawns (and
    nbdist's SSH cluster hands it to the hosts when it starts them), so it must be active
    until the workers are up.

    Non-daemonic, so user code may start its own child processes
    (``DataLoader(num_workers=...)``); Python forbids that in daemonic ones. Without Dask's
    statistical profiler, which walks the running cell's stack from the event loop every
    10 ms: a training step would hand the GIL to it a hundred times a second. On this
    machine (``local``), nannies and workers preload nbdist's lifeline: they stop when this
    kernel is gone, even after a SIGKILL (the kernel is named in their environment, which
    they inherit). Elsewhere they close with their connection to the scheduler, which runs in
    this kernel. Refused (:class:`~nbdist.errors.UnguardedScriptError`) from a script's
    unguarded top level.

    Without Dask's ``MALLOC_TRIM_THRESHOLD_``: setting it turns off glibc's adaptive mmap
    threshold, so every tensor over 128 KiB is mapped on allocation and unmapped on free, and
    a training step page-faults through its activations and gradient buckets again and again
    (about 950 faults a step and 1.3x the CPU of the same step under torchrun, measured on
    ``bench_training.py``'s MLP). The workers get glibc's defaults, as torchrun's do.
    """
    import dask

    settings = worker_settings()
    if local:
        refuse_unguarded_script()
        os.environ.setdefault(lifeline.ENV, lifeline.this_process())
        settings.update({"distributed.worker.preload": [lifeline.__name__],
                         "distributed.nanny.preload": [lifeline.__name__]})
    return dask.config.set(settings)
