"""ipyparallel's launchers: a profile's cluster as ipyparallel's own engine launcher (local,
ssh, mpi, Slurm, PBS, SGE, LSF) with its configuration, under the rules every launcher keeps
(:mod:`nbdist.backends.launchers`). Nothing is started here; the adapter starts what
:func:`launcher_settings` describes.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from traitlets.config import Config

from ...options import LaunchOptions
from ...runtime.boot import lifeline, preload
from ..launchers import merged

# Lines each batch launcher's engine job gets for the profile's resources, per worker.
_BATCH_LINES = {
    "slurm": (("cpus", "#SBATCH --cpus-per-task={}"), ("gpus", "#SBATCH --gpus-per-task={}")),
    "pbs": (("account", "#PBS -A {}"), ("walltime", "#PBS -l walltime={}")),
    "sge": (("walltime", "#$ -l h_rt={}"),),
    "lsf": (("walltime", "#BSUB -W {}"), ("cpus", "#BSUB -n {}")),
}


def launcher_settings(launch: LaunchOptions, timeout: float = 300.0,
                      cluster_dir: Optional[str] = None, python: Optional[str] = None
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """ipyparallel's own launcher for ``launch``: keyword arguments of ``ipp.Cluster`` (the
    engine launcher class and its configuration) and of ``start_engines`` (a batch template
    with the resource lines, where the launcher has no setting for them).

    The controller always runs on this machine under the kernel's lifeline. Engines started
    elsewhere run under the controller's (:func:`lifeline.remote_command`), with ``python``
    (the hosts' interpreter; default: this one); a batch launcher writes its job script into
    ``cluster_dir``. The profile's ``resources.options`` are the launcher's configuration
    traits, merged into what nbdist derives (e.g. ``ssh_args``, ``mpi_args``,
    ``batch_template``).
    """
    # The controller exits when this kernel is gone, even after a SIGKILL that leaves no
    # chance to stop it; so do local engines.
    config: dict[str, Any] = {"LocalControllerLauncher": {
        "controller_cmd": lifeline.command("ipyparallel.controller")}}
    # An engine gives up and exits when the controller has not answered its registration
    # within IPEngine.timeout (5 s by default): on a busy machine, engines importing torch and
    # a controller starting can take longer, and one engine of four was lost that way. The
    # start's own timeout bounds the wait instead.
    register = f"--IPEngine.timeout={timeout:g}"
    if launch.local:
        # Engines start importing torch while they start and register (runtime.boot.preload),
        # and may start before the controller has written its connection file.
        config["LocalEngineSetLauncher"] = {"engine_cmd": [
            *lifeline.command(preload.__name__), "ipyparallel.engine", register,
            f"--IPEngine.wait_for_url_file={timeout:g}"]}
        return {"config": Config(config)}, {}
    from ipyparallel.cluster.launcher import BatchSystemLauncher, find_launcher_class

    if launch.launcher == "ssh":
        from .ssh import SSHEngines as cls  # noqa: N813 - stops in one command an engine
    else:
        cls = find_launcher_class(launch.launcher, "engine")
    python = launch.options.get("remote_python") or python or sys.executable
    traits: dict[str, Any] = {
        # ends once the controller is gone for good, even in the middle of a cell
        "engine_cmd": [*lifeline.remote_command(preload.__name__, python),
                       "ipyparallel.engine", register]}
    engine_kwargs: dict[str, Any] = {}
    if launch.launcher == "ssh":
        traits["engines"] = dict(launch.hosts)
        traits["remote_python"] = python
        # Engines get the controller's addresses in their environment (IPP_CONNECTION_INFO):
        # no connection file to copy to each host first.
        config["SSHEngineLauncher"] = {"to_send": []}
    if issubclass(cls, BatchSystemLauncher):
        if cluster_dir:
            traits["batch_file_name"] = os.path.join(cluster_dir, f"{launch.launcher}_engine.sh")
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
    config[cls.__name__] = merged(traits, launch.options)
    return {"engine_launcher_class": cls, "config": Config(config)}, engine_kwargs

