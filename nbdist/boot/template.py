"""The notebook's handle on a worker template (:mod:`nbdist.runtime.boot.template`).

A template is one process on this host that has imported torch and the engine's modules;
the processes nbdist starts here (ipyparallel's engines and their nannies, the rendezvous
store) are forked from it instead of starting a fresh interpreter each. The notebook itself
never forks and never imports torch: it starts the template as a plain child process and
asks it, over a Unix socket only its user can reach, to fork a ``python -m MODULE ARGS``
with the stdin, stdout and stderr it passes.

The template lives as long as the cluster that started it (the engine adapter owns it) and
exits when the notebook closes its stdin or is gone. A request the template refuses (it is
no longer safe to fork, or the environment changed in a way that matters at import) raises
:class:`Refused`; the caller then starts a fresh process and says so.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any, Optional

from ..backends.registry import lookup
from ..runtime.boot import fork_client
from ..runtime.boot.fork_client import Forked, Refused
from ..runtime.boot.template import BASE_MODULES

__all__ = ["Forked", "Refused", "Template", "active", "fallback_line", "forks_store",
           "popen_or_fresh", "set_active", "supported"]

#: how long the template gets to exit once its stdin is closed
_CLOSE_GRACE = 5.0


def supported() -> bool:
    """Templates need Linux (``fork`` without ``exec``; per-thread counts in ``/proc``)."""
    return sys.platform.startswith("linux") and hasattr(socket, "send_fds")


def fallback_line(what: str, why: str) -> str:
    """The line nbdist prints when a process starts fresh instead of from the template."""
    return f"nbdist: {what} starts as a fresh process, not from the worker template: {why}"


class Template:
    """One template process on this host, importing ``modules`` from the moment it starts.

    :meth:`fork` asks it for a child; the first request waits until its imports are done.
    """

    def __init__(self, modules: Sequence[str] = ()) -> None:
        self._dir = tempfile.mkdtemp(prefix="nbdist-template-")  # mode 0700: ours alone
        self.path = os.path.join(self._dir, "fork.sock")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "nbdist.runtime.boot.template", self.path,
             *(modules or BASE_MODULES)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def fork(self, argv: Sequence[str], env: Optional[dict[str, str]] = None,
             cwd: Optional[str] = None, stdio: Sequence[int] = (),
             timeout: float = 300.0) -> tuple[int, socket.socket]:
        """Fork ``argv`` (``python -m MODULE ARGS``) with ``stdio`` (three descriptors,
        default: /dev/null in, this process's stdout and stderr out). Returns the child's pid
        and the connection its exit status will come on; raises :class:`Refused`."""
        who = f"the template (pid {self.pid})"
        conn = fork_client.connect(self.path, timeout, lambda: self.alive, who)
        return fork_client.request_fork(conn, argv, env, cwd, stdio, timeout, who), conn

    def popen(self, argv: Sequence[str], *, env: Optional[dict[str, str]] = None,
              cwd: Optional[str] = None, timeout: float = 300.0) -> Forked:
        """Like ``subprocess.Popen(argv, stdin=PIPE, stdout=PIPE, stderr=PIPE, text=True,
        bufsize=1)``, forked from the template; raises :class:`Refused`."""
        who = f"the template (pid {self.pid})"
        conn = fork_client.connect(self.path, timeout, lambda: self.alive, who)
        return fork_client.popen(conn, argv, env=env, cwd=cwd, timeout=timeout, who=who)

    def close(self) -> None:
        """Stop the template (its children are the engine's to stop)."""
        proc = self._proc
        if proc.poll() is None:
            try:
                proc.stdin.close()  # it exits at end of input
                proc.wait(_CLOSE_GRACE)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait(_CLOSE_GRACE)
        elif proc.stdin is not None:
            proc.stdin.close()
        shutil.rmtree(self._dir, ignore_errors=True)


#: the template of the cluster running now, if it has one (the rendezvous store forks from it)
_active: Optional[Template] = None


def active() -> Optional[Template]:
    """The running cluster's template (None without one)."""
    t = _active
    return t if t is not None and t.alive else None


def set_active(template: Optional[Template]) -> None:
    global _active
    _active = template


def forks_store(options: Any) -> bool:
    """Whether a start with ``options`` (:class:`~nbdist.options.ClusterOptions`) forks the
    rendezvous store from the cluster's template (an engine registered with ``forks_store``,
    ipyparallel, on this host): then it starts once the template is up, not beside the
    workers."""
    return (lookup(options.engine).forks_store and options.launch.local
            and options.launch.template and supported())


def popen_or_fresh(argv: list[str], what: str, **popen: Any) -> Any:
    """``argv`` forked from the active template with pipes for its stdio (see
    :meth:`Template.popen`), or where there is none or it refuses, ``subprocess.Popen``
    with ``popen`` (and a line saying why, for a refusal)."""
    t = active()
    if t is not None:
        try:
            return t.popen(argv)
        except Refused as why:
            print(fallback_line(what, str(why)), file=sys.stderr, flush=True)
    return subprocess.Popen(argv, **popen)
