"""Hosts other than the notebook's: asked before anything starts there, and the directory each
cluster's files go to.

**Before a start over SSH** each host is asked, in one short SSH command, whether the Python
that will run its workers is there with nbdist, the engine and torch. That Python is the
profile's ``resources.options.remote_python`` or, by default, the notebook's own interpreter
(``sys.executable``): the right one wherever the hosts share the notebook's filesystem (a
shared home, or the same image), and the check says so, naming the key to set, where they
do not. A host that cannot be reached, or lacks a package, is named at once and nothing is
started. The same command says whether the host sees this cluster's directory (a shared
filesystem) and which of its addresses reaches ``listen``.

**Each cluster's files** — ipyparallel's connection files, engine logs and job scripts,
batch jobs' output — go to a directory of its own, ``~/.nbdist/clusters/NAME`` (or under
``$NBDIST_CLUSTER_DIR``), never the notebook's working directory; it is removed when nbdist
stops the cluster, and kept, and named, when a start fails. Batch jobs read and write it
from the compute nodes, so it must be on a filesystem they share (a home directory usually
is).
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import LaunchFailed, OptionError
from ..options import LaunchOptions
from .registry import lookup

#: the profile key that names the hosts' Python
PYTHON_KEY = "cluster.resources.options.remote_python"
#: environment variable that moves the clusters' directories
DIR_ENV = "NBDIST_CLUSTER_DIR"
_MARK = "NBDIST-PROBE "
_MARKER = ".nbdist-cluster"
# Runs on the host (any Python 3): the modules it lacks, whether it sees the cluster's
# directory, and its address on the route to `listen` (nothing is sent: a UDP connect only
# picks the route).
_PROBE = """\
import importlib.util as u, json, os, socket, sys
out = {{"host": socket.gethostname(), "python": sys.executable,
       "missing": [m for m in {modules!r} if u.find_spec(m) is None],
       "shared": os.path.exists(os.path.expanduser({marker!r}))}}
try:
    s = socket.socket(socket.AF_INET6 if ":" in {listen!r} else socket.AF_INET, socket.SOCK_DGRAM)
    s.connect(({listen!r}, 9))
    out["route"] = s.getsockname()[0]
except Exception:
    out["route"] = None
print({mark!r} + json.dumps(out))
"""


@dataclass
class Host:
    """One host's answer to the check."""

    name: str  # as the profile names it (an SSH alias, user@host:port)
    status: int = 0
    stdout: str = ""
    stderr: str = ""
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def shared(self) -> bool:
        """Whether the host sees the cluster's directory (shares this filesystem)."""
        return bool(self.report.get("shared"))

    @property
    def route(self) -> Optional[str]:
        """The host's address on the route to ``listen``."""
        return self.report.get("route")


# ------------------------------------------------------------------------- the check


def probe_command(python: str, engine: str, listen: Optional[str],
                  cluster_dir: Optional[str] = None) -> str:
    """The shell command a host runs for the check (whether it sees ``cluster_dir``, too)."""
    marker = home_relative(os.path.join(cluster_dir, _MARKER)) if cluster_dir else "/nonexistent"
    listen = "127.0.0.1" if listen in (None, "*") else listen
    code = _PROBE.format(modules=lookup(engine).worker_imports, marker=marker, listen=listen,
                         mark=_MARK)
    return shlex.join([python, "-c", code])


def judge(hosts: Sequence[Host], python: str, given: bool, engine: str) -> None:
    """Raise, naming the host and what to do, unless every host can run the workers:
    :class:`LaunchFailed` for a host out of reach, :class:`OptionError` (naming
    :data:`PYTHON_KEY`) for a Python that is missing or lacks packages."""
    need = ", ".join(lookup(engine).worker_imports)
    for h in hosts:
        for line in h.stdout.splitlines():
            if line.startswith(_MARK):
                h.report = json.loads(line[len(_MARK):])
        if h.report:
            if h.report["missing"]:
                raise OptionError(
                    f"{python} on {h.name} lacks {', '.join(h.report['missing'])}: install "
                    f"them there, or set {PYTHON_KEY} to a Python on {h.name} that has {need}. "
                    "Nothing was started.", key="remote_python")
            continue
        err = h.stderr.strip()
        if h.status == 127 or "No such file" in err or "not found" in err:
            if given:
                why = f"{python} ({PYTHON_KEY}) is not there"
            else:
                why = (f"its workers would run this notebook's Python, {python}, which is not "
                       "there (hosts that do not share this machine's filesystem need their "
                       "own)")
            raise OptionError(f"cannot start workers on {h.name}: {why}. Set {PYTHON_KEY} to "
                              f"the Python on {h.name} that has {need}. Nothing was started.",
                              key="remote_python")
        raise LaunchFailed(
            f"cannot run a command on {h.name} over SSH ({err.splitlines()[-1] if err else ''}"
            f"{'; ' if err else ''}exit status {h.status}): check that `ssh {h.name}` works "
            "from this machine without a password or prompt (the profile's "
            "resources.options pass ssh's own settings: ssh_args for ipyparallel, "
            "connect_options for dask). Nothing was started.")


def check_with_ssh(hosts: Sequence[str], command: str, ssh: Sequence[str],
                   timeout: float = 60.0) -> list[Host]:
    """Run ``command`` on every host with OpenSSH's client (``ssh`` with its arguments), all
    at once; ``user@host:port`` as ipyparallel spells it."""

    def one(name: str) -> Host:
        target, port = name, []
        if ":" in name.rsplit("@", 1)[-1]:
            target, p = name.rsplit(":", 1)
            port = ["-p", p]
        try:
            r = subprocess.run([*ssh, *port, target, command], capture_output=True, text=True,
                               timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return Host(name, 255, stderr=f"no answer within {timeout:g} s")
        except OSError as exc:  # no ssh client here
            return Host(name, 255, stderr=str(exc))
        return Host(name, r.returncode, r.stdout, r.stderr)

    with ThreadPoolExecutor(max(1, len(hosts))) as pool:
        return list(pool.map(one, hosts))


def check_with_asyncssh(hosts: Sequence[str], command: str, connect_options: Mapping[str, Any],
                        timeout: float = 60.0) -> list[Host]:
    """Run ``command`` on every host with asyncssh (as Dask's SSH workers connect), all at
    once, on an event loop of its own (the notebook's may be running)."""
    import asyncssh

    async def one(name: str) -> Host:
        try:
            async with asyncssh.connect(name, **connect_options) as conn:
                r = await conn.run(command, timeout=timeout)
        except (OSError, asyncssh.Error, asyncio.TimeoutError) as exc:
            return Host(name, 255, stderr=f"{type(exc).__name__}: {exc}")
        return Host(name, int(r.exit_status or 0), str(r.stdout or ""), str(r.stderr or ""))

    async def every() -> list[Host]:
        return list(await asyncio.wait_for(asyncio.gather(*map(one, hosts)), timeout))

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, every()).result()


def check_ssh_hosts(launch: LaunchOptions, engine: str, cluster_dir: Optional[str] = None
                    ) -> tuple[list[Host], str]:
    """Check ``launch``'s hosts for ``engine`` before a start (raising as :func:`judge`
    does): the hosts as found, and the Python their workers will run. The hosts are reached
    as the engine's launcher reaches them (its registered ``ssh_client``): with OpenSSH's
    client and the profile's ``ssh_cmd``/``ssh_args`` (ipyparallel), or with asyncssh and its
    ``connect_options`` (Dask)."""
    opts = launch.options
    given = opts.get("remote_python")
    python = given or sys.executable
    command = probe_command(python, engine, launch.listen, cluster_dir)
    if lookup(engine).ssh_client == "asyncssh":
        hosts = check_with_asyncssh(list(launch.hosts), command,
                                    opts.get("connect_options") or {})
    else:
        hosts = check_with_ssh(list(launch.hosts), command, ssh_command(launch))
    judge(hosts, python, bool(given), engine)
    return hosts, python


def ssh_command(launch: LaunchOptions) -> list[str]:
    """ipyparallel's ssh command with its arguments, as the profile sets them."""
    return [*launch.options.get("ssh_cmd", ["ssh"]), *launch.options.get("ssh_args", [])]


def failure_text(exc: BaseException) -> str:
    """What a launcher's failed command said: the command, its exit status and the last line
    of its output, for an error message."""
    if isinstance(exc, subprocess.CalledProcessError):
        cmd = exc.cmd if isinstance(exc.cmd, str) else shlex.join(map(str, exc.cmd))
        said = [line for out in (exc.stderr, exc.output) if out
                for line in (out.decode(errors="replace") if isinstance(out, bytes)
                             else str(out)).splitlines() if line.strip()]
        return (f"`{cmd[:200]}` exited with status {exc.returncode}"
                + (f" ({said[-1][:300]})" if said else ""))
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ------------------------------------------------------------------ the cluster's directory


def home_relative(path: str) -> str:
    """``path`` as ``~/...`` where it is under this user's home (hosts have homes of their
    own), else as it is."""
    home = os.path.expanduser("~").rstrip(os.sep) + os.sep
    return "~" + os.sep + path[len(home):] if path.startswith(home) else path


def make_cluster_dir(engine: str) -> str:
    """A new directory for one cluster's files (mode 0700: connection files hold its key)."""
    base = os.environ.get(DIR_ENV) or os.path.join(os.path.expanduser("~"), ".nbdist",
                                                   "clusters")
    path = os.path.join(base, f"{engine}-{uuid.uuid4().hex[:12]}")
    os.makedirs(path, mode=0o700)
    with open(os.path.join(path, _MARKER), "w", encoding="utf-8") as f:
        f.write("nbdist: this cluster's files; removed when nbdist stops it\n")
    return path


def remove_cluster_dir(path: Optional[str]) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def remove_remotely(hosts: Sequence[Host], path: str, ssh: Sequence[str]) -> None:
    """Remove the cluster's directory on hosts that do not share this filesystem (where
    ipyparallel's SSH launcher wrote engine logs and a profile); best effort."""
    apart = [h.name for h in hosts if h.report and not h.shared]
    if apart:
        where = home_relative(path)
        if where.startswith("~" + os.sep):
            where = '"$HOME"/' + shlex.quote(where[2:])
        else:
            where = shlex.quote(where)
        check_with_ssh(apart, f"rm -rf {where}", ssh, timeout=30)


def log_tails(path: str, lines: int = 5, files: int = 4) -> str:
    """The last ``lines`` of the newest logs in a cluster's directory (kept when a start
    fails; those of hosts that share this filesystem are here too), for an error message."""
    logs = sorted((os.path.join(d, f) for d, _, names in os.walk(path) for f in names
                   if f.endswith((".log", ".out", ".err"))), key=os.path.getmtime)[-files:]
    parts = [f"the cluster's files are in {path}"]
    for log in logs:
        try:
            with open(log, encoding="utf-8", errors="replace") as f:
                tail = [line.rstrip() for line in f.readlines()[-lines:]]
        except OSError:
            continue
        parts.append(f"{os.path.relpath(log, path)} ends:\n    " + "\n    ".join(tail))
    return "\n".join(parts)
