"""Asking a worker template (:mod:`.template`) for a process: from the notebook
(:mod:`nbdist.boot.template`), and from an engine forked from it, for the engine's own nanny.

A request is one connection to the template's Unix socket: a JSON line (``argv``, ``env``,
``cwd``) sent with three file descriptors, the child's stdin, stdout and stderr. The reply is
the child's pid, or why the template refused; the child's exit status follows on the same
connection when it ends. Standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any, Callable, Optional

#: the environment variable that names the template's socket in an engine forked from it
ENV = "NBDIST_TEMPLATE"


class Refused(RuntimeError):
    """The template did not fork; the message says why."""


class Forked:
    """A process a template forked: the parts of :class:`subprocess.Popen` nbdist uses.

    Its exit status comes from the template (its parent) over the request's connection.
    """

    def __init__(self, pid: int, conn: socket.socket, stdin: Optional[IO] = None,
                 stdout: Optional[IO] = None, stderr: Optional[IO] = None) -> None:
        self.pid, self._conn = pid, conn
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: Optional[int] = None
        self._buf = b""
        self._lock = threading.Lock()

    def read_exit(self, timeout: Optional[float]) -> Optional[int]:
        """The exit status, waiting up to ``timeout`` (None: for ever) for the template to
        report it; None while the process runs. Where the template is gone, the status is
        unknown (-1) once the process has ended."""
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            deadline = None if timeout is None else time.monotonic() + timeout
            while b"\n" not in self._buf:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    self._conn.settimeout(left)
                    more = self._conn.recv(4096)
                except (socket.timeout, BlockingIOError):
                    return None
                except OSError:
                    more = b""
                if not more:  # the template is gone: ask the system instead
                    if _gone(self.pid):
                        self.returncode = -1
                        return self.returncode
                    if deadline is not None and time.monotonic() >= deadline:
                        return None
                    time.sleep(0.05)  # an orphan's exit offers nothing else to wait on
                    continue
                self._buf += more
            line, _, self._buf = self._buf.partition(b"\n")
            self.returncode = int(json.loads(line)["exit"])
            self._conn.close()
            return self.returncode

    def poll(self) -> Optional[int]:
        return self.read_exit(0.0)

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self.read_exit(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # a zombie that no parent reaps: it has exited
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def connect(path: str, timeout: float, alive: Callable[[], bool] = lambda: True,
            who: str = "the template") -> socket.socket:
    """A connection to the template at ``path``, once it listens (a moment after it starts;
    its imports come after). ``alive`` says whether it can still come."""
    deadline = time.monotonic() + timeout
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if not alive():
                raise Refused(f"{who} exited") from None
            if time.monotonic() > deadline:
                raise Refused(f"{who} did not listen within {timeout:g} s") from None
            time.sleep(0.01)  # it binds its socket as it starts: nothing to wait on


def request_fork(conn: socket.socket, argv: Sequence[str], env: Optional[dict[str, str]],
                 cwd: Optional[str], stdio: Sequence[int], timeout: float,
                 who: str = "the template") -> int:
    """Send one request on ``conn`` and return the child's pid (the connection then carries
    its exit status); raises :class:`Refused`. ``stdio`` are three descriptors (default:
    /dev/null in, this process's stdout and stderr out)."""
    try:
        devnull = None
        fds = list(stdio)
        if not fds:
            devnull = os.open(os.devnull, os.O_RDONLY)
            fds = [devnull, 1, 2]
        request = {"argv": list(argv), "env": dict(os.environ if env is None else env),
                   "cwd": cwd or os.getcwd()}
        try:
            socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
        finally:
            if devnull is not None:
                os.close(devnull)
        conn.settimeout(timeout)
        buf = b""
        while b"\n" not in buf:
            more = conn.recv(4096)
            if not more:
                raise Refused(f"{who} closed the request")
            buf += more
    except socket.timeout:
        conn.close()
        raise Refused(f"{who} did not answer within {timeout:g} s") from None
    except OSError as exc:
        conn.close()
        raise Refused(f"{who} could not be asked: {exc}") from None
    except BaseException:
        conn.close()
        raise
    reply = json.loads(buf.partition(b"\n")[0])
    if "pid" not in reply:
        conn.close()
        raise Refused(str(reply.get("refused", reply)))
    conn.settimeout(None)
    return int(reply["pid"])


def popen(conn: socket.socket, argv: Sequence[str], *, env: Optional[dict[str, str]] = None,
          cwd: Optional[str] = None, timeout: float = 300.0, text: bool = True,
          stderr: Optional[int] = None, who: str = "the template") -> Forked:
    """Like ``subprocess.Popen(argv, stdin=PIPE, stdout=PIPE, stderr=PIPE)``, forked by the
    template on ``conn`` (``stderr``: a descriptor to give the child instead of a pipe);
    raises :class:`Refused`."""
    pipes = [os.pipe(), os.pipe(), os.pipe() if stderr is None else None]
    theirs = [pipes[0][0], pipes[1][1], pipes[2][1] if pipes[2] else stderr]
    ours = [pipes[0][1], pipes[1][0], *([pipes[2][0]] if pipes[2] else [])]
    try:
        pid = request_fork(conn, argv, env, cwd, theirs, timeout, who)
    except BaseException:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd, pipe in zip(theirs, pipes):
            if pipe is not None:
                os.close(fd)
    files = [open(ours[0], "w" if text else "wb", buffering=1 if text else -1),  # noqa: SIM115
             *(open(fd, "r" if text else "rb") for fd in ours[1:])]  # noqa: SIM115
    return Forked(pid, conn, *files)


def fork_nanny_from_template() -> None:
    """In an ipyparallel engine forked from a template: have the engine's nanny forked from
    it too, instead of a fresh interpreter that imports ipyparallel (a few tenths of a second
    of the engine's registration). The engine starts its nanny with ``subprocess.Popen`` in
    ``ipyparallel.engine.nanny`` (loaded already: the template imported it); that one call
    goes to the template, and to a fresh process as before if the template refuses."""
    path = os.environ.get(ENV)
    nanny = sys.modules.get("ipyparallel.engine.nanny")
    if not path or nanny is None or not hasattr(nanny, "Popen"):
        return
    fresh = nanny.Popen

    def from_template(args: list[str], **kw: Any) -> Any:
        try:
            return popen(connect(path, 5.0), args, env=kw.get("env"), text=False,
                         stderr=2, timeout=30.0)
        except Refused as why:
            # into the engine's log: the error of a start that timed out quotes its end
            print(f"nbdist: the engine's nanny starts as a fresh process: {why}",
                  file=sys.stderr, flush=True)
            return fresh(args, **kw)

    nanny.Popen = from_template
