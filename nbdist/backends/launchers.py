"""How each engine's clusters are launched: the recipes, kept apart from the adapters' lifecycle.

For ipyparallel, :func:`launcher_settings` names its own engine launcher (local, ssh, mpi,
Slurm, PBS, ...) with its configuration; for Dask, :func:`cluster_spec` names the cluster class
of distributed, dask-jobqueue or dask-kubernetes with its arguments, and
:func:`worker_process_config` is the setting every Dask worker nbdist spawns is started under.
Nothing is started here; the adapters start what these describe.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

from traitlets.config import Config

from ..errors import ClusterError, MissingPackageError
from ..options import LaunchOptions
from ..runtime.boot import lifeline, preload

if TYPE_CHECKING:
    import dask

# ----------------------------------------------------------------------------- ipyparallel

# Lines each batch launcher's engine job gets for the profile's resources, per worker.
_BATCH_LINES = {
    "slurm": (("cpus", "#SBATCH --cpus-per-task={}"), ("gpus", "#SBATCH --gpus-per-task={}")),
    "pbs": (("account", "#PBS -A {}"), ("walltime", "#PBS -l walltime={}")),
    "sge": (("walltime", "#$ -l h_rt={}"),),
    "lsf": (("walltime", "#BSUB -W {}"), ("cpus", "#BSUB -n {}")),
}


def launcher_settings(launch: LaunchOptions, timeout: float = 300.0
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """ipyparallel's own launcher for ``launch``: keyword arguments of ``ipp.Cluster`` (the
    engine launcher class and its configuration) and of ``start_engines`` (a batch template
    with the resource lines, where the launcher has no setting for them).

    The profile's ``resources.options`` are the launcher's configuration traits and win over
    what nbdist derives (e.g. ``ssh_args``, ``mpi_args``, ``batch_template``).
    """
    if launch.local:
        # Controller and engines run under a lifeline: they exit when this kernel is gone,
        # even after a SIGKILL that leaves no chance to stop them.
        return {"config": Config({
            "LocalControllerLauncher": {
                "controller_cmd": lifeline.command("ipyparallel.controller")},
            # Engines start importing torch while they start and register (runtime.boot.preload),
            # and may start before the controller has written its connection file.
            "LocalEngineSetLauncher": {"engine_cmd": [
                *lifeline.command(preload.__name__), "ipyparallel.engine",
                f"--IPEngine.wait_for_url_file={timeout:g}"]}})}, {}
    from ipyparallel.cluster.launcher import BatchSystemLauncher, find_launcher_class

    cls = find_launcher_class(launch.launcher, "engine")
    traits: dict[str, Any] = {}
    engine_kwargs: dict[str, Any] = {}
    if launch.launcher == "ssh":
        traits["engines"] = dict(launch.hosts)
    if issubclass(cls, BatchSystemLauncher):
        if launch.queue:
            traits["queue"] = launch.queue
        if launch.launcher == "slurm":
            if launch.account:
                traits["account"] = launch.account
            if launch.walltime:
                traits["timelimit"] = launch.walltime
        if launch.launcher == "pbs" and (launch.cpus or launch.gpus or launch.memory):
            chunk = "".join(f":{k}={v}" for k, v in (("ncpus", launch.cpus),
                                                     ("ngpus", launch.gpus),
                                                     ("mem", launch.memory)) if v)
            extra = [f"#PBS -l select=1{chunk}"]
        else:
            extra = []
        extra += [line.format(getattr(launch, key))
                  for key, line in _BATCH_LINES.get(launch.launcher, ()) if getattr(launch, key)]
        if extra:
            # ipyparallel adds its queue, account, time and array lines to its default
            # template; a template of our own would lose them, so extend the default instead.
            first, rest = cls.class_traits()["default_template"].default_value.split("\n", 1)
            engine_kwargs["default_template"] = "\n".join([first, *extra, rest])
    traits.update(launch.options)
    return {"engine_launcher_class": cls, "config": Config({cls.__name__: traits})}, \
        engine_kwargs


# ----------------------------------------------------------------------------- dask

_JOBQUEUE = {"slurm": "SLURMCluster", "pbs": "PBSCluster", "sge": "SGECluster",
             "lsf": "LSFCluster"}


def cluster_spec(launch: LaunchOptions, n: int, tag: str = "nbdist"
                 ) -> tuple[str, str, str, dict[str, Any], bool]:
    """The Dask cluster class for ``launch`` and its arguments.

    Returns ``(module, class name, package that provides it, keyword arguments, whether the
    cluster must then be scaled to n)``: Dask's ``SSHCluster`` for ``ssh`` (scheduler on the
    first host), dask-jobqueue's ``SLURMCluster``/``PBSCluster``/``SGECluster``/``LSFCluster``
    (one worker process per job), dask-kubernetes' ``KubeCluster``. The profile's
    ``resources.options`` are the class's own keyword arguments and win.
    """
    kwargs: dict[str, Any]
    if launch.launcher == "ssh":
        hosts = [h for host, count in launch.hosts.items() for h in [host] * count]
        kwargs = {"hosts": [next(iter(launch.hosts), "localhost"), *hosts],
                  "worker_options": {"nthreads": 1}}
        spec = ("distributed.deploy.ssh", "SSHCluster", "asyncssh", kwargs, False)
    elif launch.launcher in _JOBQUEUE:
        kwargs = {"processes": 1}
        for key, arg in (("cpus", "cores"), ("memory", "memory"), ("queue", "queue"),
                         ("account", "account"), ("walltime", "walltime")):
            if getattr(launch, key):
                kwargs[arg] = getattr(launch, key)
        if launch.gpus and launch.launcher == "slurm":
            kwargs["job_extra_directives"] = [f"--gres=gpu:{launch.gpus}"]
        if launch.listen:
            host = "0.0.0.0" if launch.listen == "*" else launch.listen
            kwargs["scheduler_options"] = {"host": host}
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
    spec[3].update(launch.options)
    return spec


def import_cluster_class(module: str, name: str, package: str, launcher: str) -> Any:
    """The cluster class, imported now; a missing package is named with how to install it."""
    what = f"the dask engine's {launcher!r} launcher"
    # SSHCluster imports without asyncssh and fails only once it connects.
    needed = "asyncssh" if package == "asyncssh" else module.split(".")[0]
    if importlib.util.find_spec(needed) is None:
        raise MissingPackageError(what, package)
    # dask_jobqueue.runner replaces SIGINT's handler with sys.exit when imported: in a
    # kernel, Jupyter's stop button would then raise SystemExit instead of interrupting.
    sigint = _sigint_handler()
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise MissingPackageError(what, package) from exc
    finally:
        if sigint is not None:
            signal.signal(signal.SIGINT, sigint)


def _sigint_handler() -> Any:
    """SIGINT's handler now, when this thread may set it again; else None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.getsignal(signal.SIGINT)


#: glibc's setting that Dask's nannies give their workers (see worker_process_config)
MALLOC_TRIM = "MALLOC_TRIM_THRESHOLD_"


def worker_process_config() -> dask.config.set:
    """Config for the worker processes nbdist spawns; the nanny reads it when it spawns, so it
    must be active until the workers are up.

    Non-daemonic, so user code may start its own child processes
    (``DataLoader(num_workers=...)``); Python forbids that in daemonic ones. Without Dask's
    statistical profiler, which walks the running cell's stack from the event loop every
    10 ms: a training step would hand the GIL to it a hundred times a second. Nannies and
    workers preload nbdist's lifeline: they stop when this kernel is gone, even after a
    SIGKILL (the kernel is named in their environment, which they inherit).

    Without Dask's ``MALLOC_TRIM_THRESHOLD_``: setting it turns off glibc's adaptive mmap
    threshold, so every tensor over 128 KiB is mapped on allocation and unmapped on free, and
    a training step page-faults through its activations and gradient buckets again and again
    (about 950 faults a step and 1.3x the CPU of the same step under torchrun, measured on
    ``bench_training.py``'s MLP). The workers get glibc's defaults, as torchrun's do.
    """
    import dask  # the dask engine's extra: imported by the engine that needs it

    os.environ.setdefault(lifeline.ENV, lifeline.this_process())
    environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {})
    environ.pop(MALLOC_TRIM, None)
    return dask.config.set({"distributed.worker.daemon": False,
                            "distributed.worker.profile.enabled": False,
                            "distributed.worker.preload": [lifeline.__name__],
                            "distributed.nanny.preload": [lifeline.__name__],
                            "distributed.nanny.pre-spawn-environ": environ})
