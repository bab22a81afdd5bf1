"""How a process of a job starts reporting, decided once at its start.

``nbdist-attach.pth`` (installed with the package) runs :func:`activate` at every interpreter
start where ``NBDIST_ATTACH`` is set, and only there: without the variable nothing of nbdist
is imported. ``python -m nbdist.agent`` calls it too. A process is then one of:

* **the launcher** (``torchrun`` or ``python -m torch.distributed.run``): the node's forwarder
  (:mod:`.forwarder`), alive across its ranks' restarts. It makes the spool directory and
  puts it in its environment (:data:`~.wire.SPOOL_ENV`), which every rank it starts inherits,
  and holds the directory's lock while it lives: should it be killed (its ranks run on), the
  first of its ranks to take the lock forwards from then on;
* **a rank** (torchrun's ``RANK``, Slurm's ``SLURM_PROCID`` in a job step, Open MPI's or
  PMI's rank): it reports (:mod:`.rank`) through its launcher's forwarder, or, without one
  (``srun``, ``mpirun``), through the node's: the first rank of the job on the host to lock
  the job's directory runs the forwarder in a thread. A batch script's own processes are not
  ranks: Slurm sets ``SLURM_PROCID=0`` there too, but no ``SLURM_STEP_ID``;
* **a ``%nbdist run`` script's rank** (:data:`~.wire.RUN_SPOOL_ENV` set by its worker, which
  starts it with ``python -m nbdist.agent``): it reports to the spool directory the variable
  names, which its worker reads and relays as the rank's events; no notebook address;
* anything else (a process a rank started, a tool run with the variable set): nothing.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from . import wire

#: what the launcher's command line holds, as ``sys.orig_argv`` gives it
_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")
_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")

_started: Optional[Any] = None  # the forwarder or the rank agent of this process
_held: Optional[int] = None  # the launcher's lock on its node's directory (an open fd)
#: the lock file in a node's spool directory: held by whoever forwards from it
LOCK = "forwarder.lock"


def role(env: Any = os.environ, argv: Optional[list[str]] = None) -> Optional[str]:
    """``"launcher"``, ``"rank"`` or None for this process (see the module's text)."""
    if env.get(wire.RANK_ENV):
        return None
    if env.get(wire.RUN_SPOOL_ENV):  # a `%nbdist run` script's rank: its worker reads it
        return "rank"
    if not env.get(wire.ENV):
        return None
    argv = list(getattr(sys, "orig_argv", sys.argv)) if argv is None else argv
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] in _LAUNCHERS:
            return "launcher"
        if os.path.basename(arg) == "torchrun" and i == 1:
            return "launcher"
    # srun's tasks have a step; a batch script's processes (data preparation, a Python batch
    # script that calls srun) have SLURM_PROCID but are not ranks of the step it starts
    in_step = "SLURM_PROCID" in env and "SLURM_STEP_ID" in env
    return "rank" if in_step or any(v in env for v in _RANK_VARS) else None


def node_directory(address: wire.Address, env: Any = os.environ) -> str:
    """The job's directory on this host when no launcher made one: named from the token and
    the job (so two jobs, or two notebooks, never share it), under the temporary directory."""
    import hashlib
    import tempfile

    key = wire.job_key(env) or f"ppid-{os.getppid()}"
    tag = hashlib.sha256(f"{address.token}\0{key}".encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"nbdist-attach-{tag}")


def _elect(address: wire.Address) -> str:
    """The spool directory of this rank's node; the first rank to lock it forwards."""
    import fcntl
    import threading

    directory = node_directory(address)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if os.stat(directory).st_uid != os.getuid():
        raise PermissionError(f"{directory} belongs to another user")
    fd = os.open(os.path.join(directory, LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # another rank of this node forwards; this one stands by to take over
        threading.Thread(target=_stand_by, args=(address, directory, fd),
                         name="nbdist-standby", daemon=True).start()
        return directory
    _forward(address, directory)
    return directory


def _forward(address: wire.Address, directory: str) -> None:
    """Run the node's forwarder in this rank. It waits at the rank's exit for its node's other
    ranks, a few seconds at most, then removes the directory (a rank still running goes on
    unreported)."""
    import atexit

    from .forwarder import Forwarder

    forwarder = Forwarder(address, directory).start()
    atexit.register(forwarder.close, 10.0)
    agent = rank_agent()
    if agent is not None:
        # A rank that took over later: its own end must be written before its forwarder
        # closes (atexit runs last-registered first), or the close waits for it in vain
        # and the notebook never hears how this rank ended
        atexit.unregister(agent.end)
        atexit.register(agent.end)


def _stand_by(address: wire.Address, directory: str, fd: int) -> None:
    """Wait for the node's lock: its holder died (a killed rank's lock goes with it) or ended.
    A directory still there has ranks still writing: this rank forwards for them from now on
    (the new forwarder reads their files from the start; the notebook takes each frame
    once). Gone, the node's forwarder ended as planned."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.path.isdir(directory):
            _forward(address, directory)
    except Exception as exc:  # the job must not notice
        sys.__stderr__.write(f"nbdist: could not take over the node's forwarder: {exc!r}\n")


def activate(measure: bool = True) -> Optional[str]:
    """Start what this process's :func:`role` asks for; returns the role (None: nothing).

    A bad ``NBDIST_ATTACH`` or a failure to start is said on stderr once, and the job runs on
    unreported: it never fails because of the notebook."""
    global _started
    which = role()
    if which is None or _started is not None:
        return which
    try:
        if which == "launcher":
            address = wire.parse(os.environ[wire.ENV])
            import atexit
            import tempfile

            from .forwarder import Forwarder

            directory = tempfile.mkdtemp(prefix="nbdist-attach-")
            os.environ[wire.SPOOL_ENV] = directory
            _hold(directory)
            _started = Forwarder(address, directory).start()
            atexit.register(_started.close, 10.0)
        else:
            from .rank import RankAgent

            launcher = (None if os.environ.get(wire.RUN_SPOOL_ENV)
                        else os.environ.get(wire.SPOOL_ENV))
            directory = (os.environ.get(wire.RUN_SPOOL_ENV) or launcher
                         or _elect(wire.parse(os.environ[wire.ENV])))
            os.environ[wire.RANK_ENV] = str(os.getpid())  # its own children stay quiet
            _started = RankAgent(directory).start(measure)
            if launcher:
                _outlive(wire.parse(os.environ[wire.ENV]), launcher)
    except Exception as exc:
        sys.stderr.write(f"nbdist: not reporting to the notebook: {exc}\n")
        return None
    return which


def _hold(directory: str) -> None:
    """The launcher takes its directory's lock for as long as it lives (the fd is not
    inherited: a rank it starts does not hold it)."""
    import fcntl

    global _held
    _held = os.open(os.path.join(directory, LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(_held, fcntl.LOCK_EX)


def _outlive(address: wire.Address, directory: str) -> None:
    """A launcher's rank stands by to forward for its node should the launcher be killed
    (its lock goes with it, its directory stays: the ranks run on). A launcher that ends as
    planned removes the directory first, and the rank then does nothing."""
    import threading

    try:
        fd = os.open(os.path.join(directory, LOCK), os.O_RDWR)
    except OSError:  # a launcher of before the lock: nobody to outlive
        return
    threading.Thread(target=_stand_by, args=(address, directory, fd),
                     name="nbdist-standby", daemon=True).start()


def rank_agent() -> Optional[Any]:
    """This process's rank agent, if it reports as a rank."""
    from .rank import RankAgent

    return _started if isinstance(_started, RankAgent) else None
