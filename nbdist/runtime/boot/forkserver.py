"""Python's multiprocessing forkserver as the worker template of Dask's nannies.

Imported as the forkserver's first preload module (the notebook sets the list: this module,
then Dask's own): it holds numpy's BLAS pool to one thread, imports what a worker's first
cell needs (:data:`.template.BASE_MODULES`), and checks :func:`.template.fork_hazards`
before each fork. The forkserver runs nothing but its loop after that, so it stays safe; if
it ever is not, the child does not go on as a copy of it: it replaces itself at once with a
fresh interpreter that serves the same request (as a spawned worker would), and the
forkserver says so on its stderr (the notebook's log) with the reason.

Where the forkserver's child entry (``multiprocessing.forkserver._serve_one``) is not the
one this module knows, nothing is wrapped; the notebook checks the same and starts Dask's
workers the usual way then (:func:`.template.forkserver_supported`).
"""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing import forkserver
from typing import Any

from . import template


def _before_fork() -> None:
    """In the forkserver, right before each fork: is it still safe? (At-fork handlers are
    inherited: in a worker forked from it, a fork is the user's, not the template's.)"""
    global _hazards
    if os.getpid() != _server_pid:
        return
    _hazards = template.fork_hazards(_allowed)
    if _hazards:
        print(f"nbdist: the worker template (pid {os.getpid()}) is not safe to fork: "
              f"{'; '.join(_hazards)}. This Dask worker starts as a fresh process instead.",
              file=sys.stderr, flush=True)


def _serve_one(child_r: int, fds: list[int], unused_fds: list[int],
               handlers: dict[Any, Any]) -> int:
    """In the forked child: go on as the worker (safe), or exec a fresh one (not)."""
    if not _hazards:
        template.restore_blas(_blas_before)
        return _original(child_r, fds, unused_fds, handlers)
    signal.set_wakeup_fd(-1)
    for sig, val in handlers.items():
        signal.signal(sig, val)
    for fd in unused_fds:
        os.close(fd)
    for fd in (child_r, *fds):
        os.set_inheritable(fd, True)
    env = dict(os.environ)
    env.pop("OPENBLAS_NUM_THREADS", None)
    if _blas_before is not None:
        env["OPENBLAS_NUM_THREADS"] = _blas_before
    code = (f"from nbdist.runtime.boot.template import fresh_forkserver_child; "
            f"fresh_forkserver_child({child_r}, {list(fds)!r})")
    os.execve(sys.executable, [sys.executable, "-c", code, template.FRESH], env)
    return 1  # not reached: execve replaced this process


_hazards: list[str] = []
_server_pid = os.getpid()
_blas_before = template.limit_blas()
template.import_all(template.BASE_MODULES)
_allowed = frozenset(template.open_sockets())  # the forkserver's own listener
_original = getattr(forkserver, "_serve_one", None)
if template.forkserver_supported():
    os.register_at_fork(before=_before_fork)
    forkserver._serve_one = _serve_one  # type: ignore[attr-defined]
