"""The worker template: one process per host that has imported torch, from which workers fork.

A worker's start is mostly imports: torch, ``torch.distributed``, DDP's ``torch._dynamo``
dependency, the engine's own modules (1-3 s of CPU a process). The template pays them once,
without touching CUDA, and every worker after that (at start, at a scale, a replacement in an
elastic heal) is a fork of it that runs at once: as Python's forkserver with preloaded
modules, and PyTorch's DataLoader workers, do.

A fork copies one thread and every lock of the process, so the template is kept fork-safe:
it runs no thread (numpy's OpenBLAS pool is held to one thread while it imports, and each
child gets the pool a fresh process would have), never initializes CUDA, and holds no socket
but its own listener. :func:`fork_hazards` checks that before each fork; a template that is
no longer safe refuses, and the worker starts as a fresh process instead, with a line that
says why.

Two ways in:

* ``python -m nbdist.runtime.boot.template SOCKET [MODULE...]``: a fork server for commands
  of the form ``python -m MODULE ARGS`` (ipyparallel's engines and their nannies, the
  rendezvous store). The notebook sends one request per connection on the Unix socket
  ``SOCKET`` (in a directory only its user can enter; the peer's uid is checked too): a JSON
  line with ``argv``, ``env`` and ``cwd``, and the child's stdin, stdout and stderr as file
  descriptors. The reply is ``{"pid": N}`` (or ``{"refused": why}``) and, once the child
  ends, ``{"exit": code}`` (negative: killed by that signal). The template exits when its
  stdin reaches end of file: the notebook closed it, or the notebook is gone.
* as the preload of Python's multiprocessing forkserver (Dask's nannies), through
  :mod:`.forkserver`: the same imports and the same check before each fork.

Standard library only at import; the template's imports are its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import traceback
from typing import Any, Optional

#: what a worker imports before its first training cell (as :mod:`.preload` does), slowest first
BASE_MODULES = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
                "nbdist.runtime.worker", "nbdist.runtime.group",
                "nbdist.runtime.measure.ddp_hooks", "nbdist.runtime.measure.tqdm_bars")
#: environment variables that take effect when a module is imported: a request whose values
#: differ from the template's own would get a child that does not match its environment
IMPORT_TIME_ENV = ("PYTHON", "LD_", "TORCH", "PYTORCH", "VIRTUAL_ENV", "CONDA_PREFIX")
#: import-time variables a forked child applies itself
_APPLIED_AFTER_FORK = ("PYTHONUNBUFFERED",)
#: the preload module that makes Python's multiprocessing forkserver a template (Dask)
FORKSERVER_PRELOAD = "nbdist.runtime.boot.forkserver"
#: in the command line of a worker that started fresh where the forkserver was not safe
FRESH = "--nbdist-fresh-worker"
#: the forkserver's child entry this package wraps (``multiprocessing.forkserver``)
_SERVE_ONE = ("child_r", "fds", "unused_fds", "handlers")
#: the BLAS pool size the template imports with, in its own environment only
_BLAS_ENV = "OPENBLAS_NUM_THREADS"
_BLAS_SET = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
             "openblas_set_num_threads64_", "openblas_set_num_threads")


# ------------------------------------------------------------------------------ fork safety
def thread_count() -> int:
    """Threads of this process as the kernel counts them (native ones included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def open_sockets(allowed: frozenset[int] = frozenset()) -> list[int]:
    """File descriptors of this process that are sockets, less ``allowed``."""
    out = []
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in fds:
        fd = int(name)
        if fd in allowed:
            continue
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                out.append(fd)
    return out


def fork_hazards(allowed_sockets: frozenset[int] = frozenset()) -> list[str]:
    """Why forking this process now would not be safe; empty when it is.

    A forked child holds a copy of every lock of the parent but only the forking thread: a
    lock another thread held stays held for ever (a deadlock in the child). CUDA cannot be
    used in a child of a process that initialized it. A socket the child inherits is shared
    with the template.
    """
    hazards = []
    n = thread_count()
    if n != 1:
        hazards.append(f"{n} threads run in it")
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            cuda = bool(torch.cuda.is_initialized())
        except Exception:  # a broken CUDA build: nothing to inherit
            cuda = False
        if cuda:
            hazards.append("CUDA is initialized in it")
    sockets = open_sockets(allowed_sockets)
    if sockets:
        hazards.append(f"it holds {len(sockets)} socket(s) of its own (fd "
                       f"{', '.join(map(str, sockets))})")
    return hazards


def env_mismatch(theirs: dict[str, str], before: dict[str, str],
                 after: Optional[dict[str, str]] = None) -> list[str]:
    """Import-time variables (:data:`IMPORT_TIME_ENV`) that ``theirs`` sets otherwise than
    the template's environment: ``before`` its imports, and ``after`` them (an import may set
    one itself, as ``torch._dynamo`` does ``TORCHINDUCTOR_CACHE_DIR``: that counts only where
    ``theirs`` sets it otherwise)."""
    after = before if after is None else after
    keys = {k for k in (*theirs, *before)
            if k.startswith(IMPORT_TIME_ENV) and k not in _APPLIED_AFTER_FORK}
    return sorted(k for k in keys if theirs.get(k) != after.get(k))


def limit_blas() -> Optional[str]:
    """Hold numpy's OpenBLAS pool to one thread (none started) for imports to come; returns
    the variable's value before, to give children back (None: it was not set)."""
    before = os.environ.get(_BLAS_ENV)
    os.environ[_BLAS_ENV] = "1"
    return before


def restore_blas(before: Optional[str]) -> None:
    """In a forked child: the environment and the OpenBLAS pool a fresh process would have."""
    if before is None:
        os.environ.pop(_BLAS_ENV, None)
    else:
        os.environ[_BLAS_ENV] = before
    want = next((os.environ[k] for k in (_BLAS_ENV, "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
                 if os.environ.get(k)), None)
    try:
        n = int(want) if want else len(os.sched_getaffinity(0))
    except (ValueError, AttributeError):
        n = os.cpu_count() or 1
    if n > 1:
        _set_blas_threads(n)


def _set_blas_threads(n: int) -> None:
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            libs = {line.split()[-1] for line in f if "openblas" in line.lower()}
    except OSError:
        return
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        fn = next((getattr(lib, s) for s in _BLAS_SET if hasattr(lib, s)), None)
        if fn is not None:
            fn(ctypes.c_int(n))


def import_all(modules: tuple[str, ...]) -> None:
    """Import ``modules`` in order; one that fails is left to the worker that needs it (it
    imports it again and reports the error there). Then freeze what the imports made out of
    the cyclic collector's reach (``gc.freeze``): a fork's collections neither walk those
    objects (a fresh worker's full collections do) nor write to their pages, which the fork
    shares with the template until written."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    gc.collect()
    gc.freeze()


def forkserver_supported() -> bool:
    """True where Python's forkserver has the child entry :mod:`.forkserver` wraps (Linux,
    ``multiprocessing.forkserver._serve_one(child_r, fds, unused_fds, handlers)``)."""
    import inspect
    from multiprocessing import forkserver

    fn = getattr(forkserver, "_serve_one", None)
    return (sys.platform.startswith("linux") and fn is not None
            and tuple(inspect.signature(fn).parameters) == _SERVE_ONE)


# ------------------------------------------------------------------------------ the server
class _Server:
    """The template's loop: one thread, waiting on its listener, its stdin and SIGCHLD."""

    def __init__(self, path: str, blas_before: Optional[str]) -> None:
        self.blas_before = blas_before
        self.env = self.env_after = self._environ()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.children: dict[int, socket.socket] = {}  # pid -> the connection to report to
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def _environ(self) -> dict[str, str]:
        """This process's environment, as given (without the BLAS limit of its own)."""
        env = dict(os.environ)
        env.pop(_BLAS_ENV, None)
        if self.blas_before is not None:
            env[_BLAS_ENV] = self.blas_before
        return env

    def run(self) -> None:
        self.env_after = self._environ()
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the fd
        signal.set_wakeup_fd(self.wake_w)
        # Its children outlive it by design: each ends with the notebook on its own (a
        # lifeline, or its stdin from the notebook), as a fresh process would.
        while True:
            try:
                ready, _, _ = select.select([self.listener, sys.stdin, self.wake_r], [], [])
            except InterruptedError:
                continue
            if self.wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
                self.reap()
            if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
                return  # the notebook closed our stdin, or is gone
            if self.listener in ready:
                conn, _ = self.listener.accept()
                self.serve(conn)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(_line({"exit": os.waitstatus_to_exitcode(status)}))
                conn.close()

    def serve(self, conn: socket.socket) -> None:
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError) as exc:
            with contextlib.suppress(OSError):
                conn.sendall(_line({"refused": f"bad request: {exc}"}))
            conn.close()
            return
        try:
            why = self.refusal(conn, request)
            if why:
                conn.sendall(_line({"refused": why}))
                conn.close()
                return
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _become(request, fds, self)  # never returns
            self.children[pid] = conn
            conn.sendall(_line({"pid": pid}))
        except OSError:
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)

    def refusal(self, conn: socket.socket, request: dict[str, Any]) -> str:
        """Why this request gets no fork ("" when it does)."""
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  struct.calcsize("3i")))[1]
        if uid != os.getuid():
            return "the request came from another user"
        argv = request.get("argv") or []
        if len(argv) < 3 or argv[1] != "-m":
            return f"it forks `python -m MODULE` commands only, not {argv[:3]}"
        if os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
            return f"it runs {sys.executable}, not {argv[0]}"
        changed = env_mismatch(request.get("env") or {}, self.env, self.env_after)
        if changed:
            return (f"the environment changed since it started ({', '.join(changed[:4])}), "
                    "and takes effect at import")
        allowed = frozenset([self.listener.fileno(), conn.fileno(),
                             *(c.fileno() for c in self.children.values())])
        hazards = fork_hazards(allowed)
        return "; ".join(hazards)


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj) + "\n").encode()


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One request: its JSON line and the three stdio descriptors sent with its first bytes."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            raise ValueError("the request ended early")
        data += more
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"3 file descriptors (stdin, stdout, stderr) expected, got {len(fds)}")
    return json.loads(data), fds


def _become(request: dict[str, Any], fds: list[int], server: _Server) -> None:
    """In the forked child: become ``python -m MODULE ARGS`` as the request describes."""
    code: Any = 1
    try:
        os.setsid()  # its own session, as a launcher's process: no signal of the template's
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        keep = set(range(3))
        for fd in (server.listener.fileno(), server.wake_r, server.wake_w, *fds,
                   *(c.fileno() for c in server.children.values())):
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        os.chdir(request.get("cwd") or os.getcwd())
        os.environ.clear()
        os.environ.update(request["env"])
        restore_blas(os.environ.get(_BLAS_ENV))
        if os.environ.get("PYTHONUNBUFFERED"):
            for stream in (sys.stdout, sys.stderr):
                stream.reconfigure(write_through=True)  # type: ignore[union-attr]
        if sys.path and sys.path[0] == _start_dir:
            sys.path[0] = os.getcwd()  # what `python -m` puts first: the directory it ran in
        module, args = request["argv"][2], request["argv"][3:]
        sys.argv = [module, *args]
        sys.modules.pop(module, None)  # `python -m` runs it fresh, as __main__
        import runpy

        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            import atexit

            atexit._run_exitfuncs()  # what an interpreter's exit runs
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if code is None:
            code = 0
        elif not isinstance(code, int):
            with contextlib.suppress(Exception):
                print(code, file=sys.stderr, flush=True)
            code = 1
        os._exit(code)


#: the directory the template started in (``sys.path[0]`` under ``python -m``)
_start_dir = os.getcwd()


def fresh_forkserver_child(child_r: int, fds: list[int]) -> None:
    """A fresh interpreter serving one multiprocessing forkserver request, as the forked
    child would have (``multiprocessing.forkserver._serve_one``): where the template was not
    safe to fork (:mod:`.forkserver`)."""
    from multiprocessing import forkserver, resource_tracker, spawn

    (forkserver._forkserver._forkserver_alive_fd,  # type: ignore[attr-defined]
     resource_tracker._resource_tracker._fd,  # type: ignore[attr-defined]
     *forkserver._forkserver._inherited_fds) = fds  # type: ignore[attr-defined]
    parent_sentinel = os.dup(child_r)
    sys.exit(spawn._main(child_r, parent_sentinel))  # type: ignore[attr-defined]


def main(argv: list[str]) -> None:
    path, *modules = argv
    blas_before = limit_blas()
    server = _Server(path, blas_before)  # listening at once: requests wait for the imports
    import_all(tuple(modules) or BASE_MODULES)
    server.run()


if __name__ == "__main__":
    main(sys.argv[1:])
