"""No orphans: processes nbdist starts exit when the kernel that started them is gone.

A kernel killed with SIGKILL runs no cleanup, and ipyparallel's controller and engines, or
Dask's nannies and workers, would run on without it. Each of them watches, and once what it
watches is gone, stops itself with SIGTERM (then, if that does not end it, exits):

* **on the kernel's host**, the kernel's process, by PID and start time (so a reused PID is
  not mistaken for it): ipyparallel's controller and local engines, Dask's local nannies and
  workers. The kernel is named ``"PID START HOST"``; a process on another host (a Slurm job
  inherits the notebook's environment) finds another host's name there and ignores it, since
  a PID means nothing across hosts.
* **on other hosts** (engines started by Slurm or over SSH), the controller they serve, which
  runs on the kernel's host under the watch above: they connect to its registration address
  every :data:`REMOTE_INTERVAL` seconds and end once it has not answered for
  :data:`REMOTE_GRACE` seconds. From a thread of their own, so a cell that runs for hours
  does not hide the controller's end (ipyparallel's own heartbeat check runs on the engine's
  event loop, which a running cell blocks). Dask's remote workers need no such watch: they
  close as soon as their connection to the scheduler breaks (the scheduler runs in the kernel),
  and their nannies with them; ``death_timeout`` ends one that never reaches the scheduler,
  and this module, preloaded, ends one whose cell keeps its thread busy
  (:func:`dask_teardown`).

Used three ways: ``python -m nbdist.runtime.boot.lifeline PID START MODULE [ARGS...]`` runs
``MODULE`` as ``__main__`` under the kernel's watch (ipyparallel's local controller and
engines), ``python -m nbdist.runtime.boot.lifeline --remote MODULE [ARGS...]`` under the
controller's (ipyparallel's engines on other hosts: :func:`remote_command`); as a Dask preload
(``dask_setup``), reading the kernel from ``NBDIST_KERNEL``, which also keeps Dask's processes
through an interrupt of the kernel; or :func:`watch` directly.
Standard library and psutil only.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional
from urllib.parse import urlsplit

#: environment variable naming the kernel to watch: ``"PID START HOST"``
ENV = "NBDIST_KERNEL"
#: how often the kernel is looked for, and how long SIGTERM gets before exiting hard
INTERVAL, GRACE = 1.0, 10.0
#: on another host: how often the controller is reached for, and how long it may not answer
#: (the controller drops an engine that misses 10 s of its heartbeats; this is a little more)
REMOTE_INTERVAL, REMOTE_GRACE = 1.0, 15.0
#: how long such a process gets to end once it knows (its handlers, and a Dask worker's close)
REMOTE_STOP_GRACE = 5.0
#: the flag of the command line that watches the controller instead of the kernel
REMOTE = "--remote"
#: where ipyparallel hands an engine its controller's addresses (JSON)
_IPP_CONNECTION = "IPP_CONNECTION_INFO"


def this_process() -> str:
    """``"PID START HOST"`` of the calling process, for the processes it starts to watch."""
    import psutil

    return f"{os.getpid()} {psutil.Process().create_time()!r} {socket.gethostname()}"


def _parse(kernel: str) -> tuple[int, float, Optional[str]]:
    """``"PID START [HOST]"`` -> its parts (``HOST`` None where the name has none)."""
    pid_s, start_s, *host = kernel.split()
    return int(pid_s), float(start_s), (host[0] if host else None)


def on_this_host(kernel: str) -> bool:
    """Whether ``kernel`` runs on this host (a name without a host is taken to)."""
    host = _parse(kernel)[2]
    return host is None or host == socket.gethostname()


def alive(pid: int, start: float) -> bool:
    """True while the process ``pid`` that started at ``start`` exists."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - start) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stop_self(grace: float = GRACE) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace)  # a handler that does not exit gets this long
    os._exit(1)


def _stop_self_soon() -> None:
    """Stop a process on another host whose controller is gone: its SIGTERM handler runs on
    an event loop that a running cell may block, so it gets :data:`REMOTE_STOP_GRACE`."""
    _stop_self(REMOTE_STOP_GRACE)


def _thread(loop: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=loop, name="nbdist-lifeline", daemon=True)
    thread.start()
    return thread


def watch(kernel: str, on_gone: Optional[Callable[[], None]] = None,
          interval: float = INTERVAL) -> Optional[threading.Thread]:
    """Watch ``kernel`` (``"PID START [HOST]"``) from a daemon thread; call ``on_gone``
    (default: stop this process) once it no longer exists. A kernel on another host is not
    watched (None is returned): its PID says nothing here."""
    if not on_this_host(kernel):
        return None
    pid, start, _ = _parse(kernel)

    def loop() -> None:
        while alive(pid, start):
            time.sleep(interval)  # a process offers nothing to wait on for another's death
        (on_gone or _stop_self)()

    return _thread(loop)


def reachable(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` now."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def watch_address(host: str, port: int, on_gone: Optional[Callable[[], None]] = None,
                  grace: float = REMOTE_GRACE, interval: float = REMOTE_INTERVAL
                  ) -> threading.Thread:
    """Watch the server at ``host:port`` from a daemon thread; call ``on_gone`` (default:
    stop this process) once it has not accepted a connection for ``grace`` seconds."""

    def loop() -> None:
        last = time.monotonic()
        while True:
            if reachable(host, port, timeout=min(2.0, interval * 2)):
                last = time.monotonic()
            elif time.monotonic() - last > grace:
                break
            time.sleep(interval)
        (on_gone or _stop_self_soon)()

    return _thread(loop)


def controller_address(info: str) -> Optional[tuple[str, int]]:
    """Where an ipyparallel engine registers, from its ``IPP_CONNECTION_INFO`` (JSON): the
    registration port on the controller's interface, or its ``location`` where the controller
    listens on every interface. None where it is not said, or reached through an SSH tunnel
    (the engine's own heartbeat check then stands)."""
    try:
        d = json.loads(info)
        url = urlsplit(f"{d['interface']}:{int(d['registration'])}")
    except (ValueError, KeyError, TypeError):
        return None
    if d.get("ssh") or url.hostname is None or url.port is None:
        return None
    host = url.hostname
    if host in ("*", "0.0.0.0", "::"):
        host = d.get("location") or ""
    return (host, url.port) if host else None


def command(module: str, kernel: Optional[str] = None) -> list[str]:
    """The command line that runs ``python -m module`` under the watch of ``kernel``."""
    pid, start, _ = _parse(kernel or this_process())
    return [sys.executable, "-m", __name__, str(pid), repr(start), module]


def remote_command(module: str, python: Optional[str] = None) -> list[str]:
    """The command line that runs ``python -m module`` on another host under the watch of the
    ipyparallel controller it registers with (``python``: that host's interpreter)."""
    return [python or sys.executable, "-m", __name__, REMOTE, module]


def _here() -> bool:
    """Whether this process runs on the kernel's host (its environment names the kernel)."""
    kernel = os.environ.get(ENV)
    return bool(kernel) and on_this_host(kernel)


def dask_setup(server: object) -> None:
    """Dask preload hook (nannies and workers): watch the kernel named in ``NBDIST_KERNEL``
    where it runs on this host, and ignore SIGINT.

    Jupyter's stop button sends SIGINT to the kernel's whole process group, which the Dask
    processes nbdist spawns belong to: it would end them. nbdist interrupts a Dask worker's
    cell by thread (:func:`nbdist.runtime.interrupt.interrupt_calls`), never by signal.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _here():
        watch(os.environ[ENV])


def dask_teardown(server: object) -> None:
    """Dask preload hook, as a worker closes: on another host (it lost the scheduler, which
    ends with the kernel, or is being stopped) a worker whose cell does not return exits
    :data:`REMOTE_STOP_GRACE` seconds later, instead of waiting half a minute for the cell's
    thread as Dask would. On the kernel's host its nanny sees to it."""
    if not _here() and type(server).__name__ == "Worker":
        timer = threading.Timer(REMOTE_STOP_GRACE, os._exit, (1,))
        timer.daemon = True
        timer.start()


def main(argv: list[str]) -> None:
    if argv[0] == REMOTE:
        module, *args = argv[1:]
        address = controller_address(os.environ.get(_IPP_CONNECTION, ""))
        if address is not None:
            watch_address(*address)
    else:
        pid, start, module, *args = argv
        watch(f"{pid} {start}")
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
