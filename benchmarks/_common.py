"""Shared helpers for the benchmarks: statistics, tables, a hard deadline, child clean-up."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


class Deadline(Exception):
    """The benchmark ran past its overall time limit."""


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def p90(xs: Sequence[float]) -> float:
    """90th percentile by linear interpolation between closest ranks."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = 0.9 * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table (first column left-aligned, the rest right-aligned)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, r in enumerate(cells):
        parts = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        return f"{c:.3f}" if abs(c) < 10 else f"{c:.1f}"
    return str(c)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> str:
    import torch

    return (f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _descendants() -> list[Any]:
    try:
        import psutil
    except ImportError:
        return []
    try:
        return psutil.Process().children(recursive=True)
    except Exception:
        return []


def kill_children() -> None:
    """Kill every process this benchmark started that is still alive (by pid, ours only)."""
    procs = _descendants()
    for p in procs:
        with contextlib.suppress(Exception):
            p.kill()
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(5)


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`Deadline` in the main thread after ``seconds``; hard-exit 60 s later.

    Wrap the whole benchmark, clean-up included: the soft deadline lets ``finally`` blocks
    inside stop clusters; the hard one kills our own children and exits if clean-up hangs.
    """

    def soft(signum: int, frame: Any) -> None:
        raise Deadline(f"overall time limit of {seconds:g} s reached")

    def hard() -> None:
        print(f"benchmark: still running {seconds:g}+60 s after start; killing its children",
              file=sys.stderr, flush=True)
        kill_children()
        os._exit(3)

    old = signal.signal(signal.SIGALRM, soft)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    timer = threading.Timer(seconds + 60, hard)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        timer.cancel()


def kill_running(script: str) -> list[int]:
    """SIGKILL every process of this user whose command line runs ``script``; their pids."""
    import psutil

    killed = []
    for p in psutil.process_iter(["cmdline", "uids"]):
        try:
            if script in (p.info["cmdline"] or ()) and p.info["uids"].real == os.getuid():
                p.kill()
                killed.append(p.pid)
        except (psutil.Error, TypeError):
            continue
    return killed


def parse_args(ap: Any, argv: Optional[Sequence[str]]) -> Any:
    """``ap.parse_args(argv)``, with ``--check``: check the command line (its arguments parse,
    the benchmark's modules import) and exit 0 without starting anything."""
    ap.add_argument("--check", action="store_true",
                    help="check the command line and exit: nothing is started")
    args = ap.parse_args(argv)
    if args.check:
        print(f"{ap.prog}: command line ok", flush=True)
        raise SystemExit(0)
    return args


def parse_result(out: str) -> Any:
    """The JSON object of the ``RESULT {...}`` line a benchmark's child process printed."""
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"no RESULT line in the output:\n{out[-2000:]}")


def run_torchrun(script: str, args: Sequence[str], nproc: int, timeout: float,
                 env: Optional[dict[str, str]] = None,
                 launcher_args: Sequence[str] = ()) -> tuple[float, str, str]:
    """Launch ``torchrun --nproc_per_node=nproc script args``; return (launch time, out, err).

    The launcher runs in its own process group, which is killed if it outlives ``timeout``.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *launcher_args,
           script, *args]
    full_env = dict(os.environ)
    full_env.pop("OMP_NUM_THREADS", None)  # torchrun sets 1 per process when nproc > 1
    full_env.update(env or {})
    t_launch = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        # torchrun starts each worker in a session of its own: once the launcher is gone they
        # are orphans that hold its output pipes open (reading them would wait forever)
        kill_running(script)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=10)
        raise
    if proc.returncode != 0:
        fd, path = tempfile.mkstemp(prefix="torchrun-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(f"$ {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}")
        raise RuntimeError(f"torchrun exited with {proc.returncode} (full log: {path}):\n"
                           f"{err[-3000:]}")
    return t_launch, out, err


class TorchrunServer:
    """A torchrun job kept running between timed windows: ``script --mode serve`` connects to
    this benchmark and trains ``steps`` steps each time :meth:`window` asks, answering one
    JSON line; between windows its ranks wait idle, so another side can run in between.
    ``env``: the job's whole environment (default this process's); ``launcher_args``:
    torchrun's own options before the script (``--standalone``, ``-m``)."""

    def __init__(self, script: str, args: Sequence[str], nproc: int, timeout: float,
                 env: Optional[dict[str, str]] = None, launcher_args: Sequence[str] = ()):
        self.script, self.timeout = script, timeout
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(timeout)
        port = self.listener.getsockname()[1]
        # --standalone picks its own rendezvous on localhost: no master address then
        master = ([] if "--standalone" in launcher_args else
                  ["--master_addr", "127.0.0.1", "--master_port", str(free_port())])
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               *master, *launcher_args, script, "--mode", "serve", "--port", str(port), *args]
        env = dict(os.environ if env is None else env)
        env.pop("OMP_NUM_THREADS", None)  # torchrun sets 1 per process when nproc > 1
        fd, self.log_path = tempfile.mkstemp(prefix="torchrun-", suffix=".log")
        self.log = os.fdopen(fd, "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        try:
            self.conn, _ = self.listener.accept()
        except BaseException:
            self.close()
            raise
        self.conn.settimeout(timeout)
        self.reader = self.conn.makefile("r")

    def window(self, steps: int) -> dict[str, Any]:
        """Have the job train ``steps`` timed steps; its figures (every rank's worst)."""
        self.conn.sendall(f"{steps}\n".encode())
        line = self.reader.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"the torchrun job ended (log: {self.log_path}):\n"
                               f"{self.log.read()[-3000:]}")
        return json.loads(line)

    def close(self) -> None:
        """Tell the job to stop and wait for it; kill it if it does not."""
        with contextlib.suppress(OSError, AttributeError):
            self.conn.sendall(b"0\n")
        try:
            self.proc.wait(timeout=60)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            kill_running(self.script)  # its workers run in sessions of their own
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        for f in (getattr(self, "reader", None), getattr(self, "conn", None), self.listener,
                  self.log):
            with contextlib.suppress(OSError, AttributeError):
                f.close()
        if self.proc.returncode == 0:  # a failed job's log stays, for its error
            os.unlink(self.log_path)
