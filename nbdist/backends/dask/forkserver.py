"""Dask's place for the worker template (:mod:`nbdist.boot.template`), on this host: Python's
multiprocessing forkserver, whose half inside the template is
:mod:`nbdist.runtime.boot.forkserver`.

The nannies of a ``LocalCluster`` run in this process and start workers through Python's
multiprocessing; :func:`use_forkserver` makes its forkserver the template (its preload imports
what a worker needs, and checks before each fork that forking is safe), and
:class:`TemplateNanny` (made by :func:`template_nanny`) has each worker start, restart and
replacement forked from it.

A worker the template cannot fork safely starts as a fresh process, with a line saying why.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any, Optional

import psutil

from ...boot.template import fallback_line, supported
from ...runtime.boot.template import FORKSERVER_PRELOAD, FRESH, forkserver_supported

#: the forkserver's preload: nbdist's (first: it limits the BLAS pool before numpy loads),
#: then what a Dask worker process imports
DASK_PRELOAD = [FORKSERVER_PRELOAD, "distributed", "distributed.nanny", "distributed.worker"]


def use_forkserver() -> Optional[str]:
    """Make this process's multiprocessing forkserver the template of Dask's workers.

    Returns why it cannot (the workers then start as fresh processes), or None.
    """
    if not supported() or not forkserver_supported():
        return f"worker templates need Linux and Python's forkserver, not {sys.platform}"
    import dask
    from distributed.utils import get_mp_context

    ctx = multiprocessing.get_context("forkserver")
    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        get_mp_context()  # Dask sets its own preload list once per process: ours replaces it
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    running = getattr(server, "_forkserver_pid", None) is not None
    if running and FORKSERVER_PRELOAD not in getattr(server, "_preload_modules", ()):
        return ("this process's multiprocessing forkserver was started before, without "
                "nbdist's preload")
    ctx.set_forkserver_preload(DASK_PRELOAD)
    return None


def stop_forkserver(timeout: float = 5.0) -> None:
    """Stop the forkserver :func:`use_forkserver` set up, once its workers are gone (it would
    otherwise stay until this process exits, holding torch's memory). Left running where
    Python's forkserver is not the one this knows."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    lock = getattr(server, "_lock", None)
    if server is None or lock is None:
        return
    with lock:
        pid = getattr(server, "_forkserver_pid", None)
        alive_fd = getattr(server, "_forkserver_alive_fd", None)
        if pid is None or alive_fd is None or FORKSERVER_PRELOAD not in getattr(
                server, "_preload_modules", ()):
            return
        os.close(alive_fd)  # the server exits once every holder of this end has closed it
        server._forkserver_alive_fd = None
        deadline = time.monotonic() + timeout
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:  # a worker still holds it: do not wait on it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.02)  # a child's exit offers nothing else to wait on here
        server._forkserver_pid = None
        address = getattr(server, "_forkserver_address", None)
        server._forkserver_address = None
        if isinstance(address, str) and not address.startswith("\0"):
            with contextlib.suppress(OSError):
                os.unlink(address)


_method_users = 0
_method_setting: Any = None


@contextlib.contextmanager
def _forkserver_method() -> Iterator[None]:
    """Dask's multiprocessing method set to the forkserver while any nanny starts a worker
    (counted: nannies start theirs concurrently on one event loop)."""
    global _method_users, _method_setting
    import dask

    if _method_users == 0:
        _method_setting = dask.config.set({
            "distributed.worker.multiprocessing-method": "forkserver",
            "distributed.worker.daemon": False})  # as worker_process_config: DataLoaders
    _method_users += 1
    try:
        yield
    finally:
        _method_users -= 1
        if _method_users == 0:
            _method_setting.__exit__(None, None, None)
            _method_setting = None


def dask_template_options() -> dict[str, Any]:
    """A ``LocalCluster``'s keywords for workers forked from the template ({} where they
    cannot be, with a line saying why: the workers then start as fresh processes)."""
    why = use_forkserver()
    if why is not None:
        print(fallback_line("each Dask worker", why), file=sys.stderr, flush=True)
        return {}
    return {"worker_class": template_nanny()}


def template_nanny() -> type:
    """Dask's ``Nanny`` with each worker process forked from the template (the forkserver
    :func:`use_forkserver` set up): at start, and when it restarts a worker that died."""
    from distributed import Nanny

    class TemplateNanny(Nanny):
        async def instantiate(self) -> Any:
            with _forkserver_method():
                status = await super().instantiate()
            _say_if_fresh(self)
            return status

    return TemplateNanny


def _say_if_fresh(nanny: Any) -> None:
    """Tell the notebook when the worker did not fork from the template (its forkserver says
    why on its own stderr)."""
    proc = getattr(getattr(nanny, "process", None), "process", None)
    pid = getattr(proc, "pid", None)
    if pid is None:
        return
    with contextlib.suppress(psutil.Error):
        if FRESH in psutil.Process(pid).cmdline():
            print(fallback_line(f"Dask worker (pid {pid})",
                                "the template was not safe to fork (its log says why)"),
                  file=sys.stderr, flush=True)
