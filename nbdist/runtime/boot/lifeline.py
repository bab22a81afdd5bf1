"""No orphans: processes nbdist starts exit when the kernel that started them is gone.

A kernel killed with SIGKILL runs no cleanup, and ipyparallel's controller and engines, or
Dask's nannies and workers, would run on without it. Each of them watches the kernel's process
(by PID and start time, so a reused PID is not mistaken for it) and, once it is gone, stops
itself with SIGTERM (then, if that does not end it, exits).

Used three ways: ``python -m nbdist.runtime.boot.lifeline PID START MODULE [ARGS...]`` runs
``MODULE`` as ``__main__`` under the watch (ipyparallel's controller and engines); as a Dask
preload (``dask_setup``), reading the kernel from ``NBDIST_KERNEL``, which also keeps Dask's
processes through an interrupt of the kernel; or :func:`watch` directly.
Standard library and psutil only.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time
from typing import Callable, Optional

#: environment variable naming the kernel to watch: ``"PID START"``
ENV = "NBDIST_KERNEL"
#: how often the kernel is looked for, and how long SIGTERM gets before exiting hard
INTERVAL, GRACE = 1.0, 10.0


def this_process() -> str:
    """``"PID START"`` of the calling process, for the processes it starts to watch."""
    import psutil

    return f"{os.getpid()} {psutil.Process().create_time()!r}"


def alive(pid: int, start: float) -> bool:
    """True while the process ``pid`` that started at ``start`` exists."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - start) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stop_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE)  # a handler that does not exit gets this long
    os._exit(1)


def watch(kernel: str, on_gone: Optional[Callable[[], None]] = None,
          interval: float = INTERVAL) -> threading.Thread:
    """Watch ``kernel`` (``"PID START"``) from a daemon thread; call ``on_gone`` (default:
    stop this process) once it no longer exists."""
    pid_s, start_s = kernel.split()
    pid, start = int(pid_s), float(start_s)

    def loop() -> None:
        while alive(pid, start):
            time.sleep(interval)  # a process offers nothing to wait on for another's death
        (on_gone or _stop_self)()

    thread = threading.Thread(target=loop, name="nbdist-lifeline", daemon=True)
    thread.start()
    return thread


def command(module: str, kernel: Optional[str] = None) -> list[str]:
    """The command line that runs ``python -m module`` under the watch of ``kernel``."""
    pid, start = (kernel or this_process()).split()
    return [sys.executable, "-m", "nbdist.runtime.boot.lifeline", pid, start, module]


def dask_setup(server: object) -> None:
    """Dask preload hook (nannies and workers): watch the kernel named in ``NBDIST_KERNEL``,
    and ignore SIGINT.

    Jupyter's stop button sends SIGINT to the kernel's whole process group, which the Dask
    processes nbdist spawns belong to: it would end them. nbdist interrupts a Dask worker's
    cell by thread (:func:`nbdist.runtime.interrupt.interrupt_calls`), never by signal.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    kernel = os.environ.get(ENV)
    if kernel:
        watch(kernel)


def main(argv: list[str]) -> None:
    pid, start, module, *args = argv
    watch(f"{pid} {start}")
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
