"""Real daemons for the launcher tests: a single-host Slurm and an sshd, on loopback only.

Debian's ``slurm-wlm``, ``munge`` and ``openssh-server`` (``scripts/test.sh`` installs them as
root). Each daemon set runs from a temporary directory of its own — configuration, keys,
state, spool, logs and PID files — and binds 127.0.0.1 only; nothing reads or writes the
system's ``/etc/slurm``, ``/etc/munge`` or anyone's ``~/.ssh``. Each checks that it works on
its own (a batch job that runs a job step; an ``ssh ... true``) before a test may use it, and
its :meth:`stop` ends, by PID, everything it started: the daemons, and what they started in
turn (Slurm's ``slurmstepd`` and job processes, sshd's sessions and the processes they left
running), which are found by what ties them to this directory or port, not by name.

Where root or a package is missing, the fixtures skip and say which.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Callable, Optional

import psutil
import pytest

#: Node-wide settings for the test Slurm. Why each one:
#: - linuxproc/task none: no cgroups in a container; jobs are tracked by process tree.
#: - cons_tres + CR_Core: single-CPU jobs share the node (one engine = one job or one task).
#: - NoInAddrAny/NoCtldInAddrAny: slurmd and slurmctld bind their configured address
#:   (loopback) rather than every interface.
#: - no accounting daemon: jobs are checked with squeue and their output files.
#: - config_overrides: the node declares NODE_CPUS cores whatever the machine has, so two
#:   single-CPU workers and the replacement of one that died all run at once on a 2-core
#:   machine (a replacement job would otherwise wait for a core that its dead predecessor's
#:   job may still hold).
_SLURM_SETTINGS = """\
SlurmdParameters=config_overrides
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
MailProg=/bin/true
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
SlurmctldDebug=info
SlurmdDebug=info
"""
#: cores the test Slurm's node declares (see _SLURM_SETTINGS)
NODE_CPUS = 8


def wait_until(predicate: Callable[[], bool], timeout: float, what: str,
               watch: Sequence[subprocess.Popen] = ()) -> float:
    """Wait for ``predicate`` (polled every 0.1 s); fail early if a process of ``watch``, those
    expected to make it true, exits. Returns the seconds waited."""
    t0 = time.monotonic()
    tick = threading.Event()
    while not predicate():
        for proc in watch:
            if proc.poll() is not None:
                raise AssertionError(f"{proc.args[0]} exited ({proc.returncode}) before {what}")
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        tick.wait(0.1)
    return time.monotonic() - t0


def free_port() -> int:
    """A TCP port nothing listens on at 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _missing(*tools: str) -> Optional[str]:
    if not sys.platform.startswith("linux"):
        return "these daemons are started here on Linux only"
    if os.geteuid() != 0:
        return "starting them needs root (scripts/test.sh installs them as root with apt)"
    absent = [t for t in tools if shutil.which(t) is None]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install slurm-wlm munge " \
               "openssh-server, as scripts/test.sh does)"
    return None


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Daemons:
    """Daemons started from one temporary directory, and everything they start.

    ``base`` is made by ``tempfile.mkdtemp`` under ``/tmp`` rather than pytest's ``tmp_path``
    (mode 0700 up its path): munged wants every directory above its socket searchable by all.
    """

    name = "daemons"

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix=f"nbdist-{self.name}-"))
        os.chmod(self.base, 0o755)
        (self.base / "log").mkdir()
        self.procs: list[subprocess.Popen] = []
        self.started_in: Optional[float] = None  # seconds from nothing to a working check

    def spawn(self, label: str, argv: list[str], **kw) -> subprocess.Popen:
        log = open(self.base / "log" / f"{label}.out", "w")  # noqa: SIM115 - the child's
        try:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, **kw)
        finally:
            log.close()
        self.procs.append(proc)
        return proc

    def _belongs(self, p: psutil.Process) -> bool:
        """A process this set's daemons started that left their process tree (``slurmstepd``
        reparents itself to init; a background command an ssh session left)."""
        return False

    def processes(self) -> list[psutil.Process]:
        """Every live process of this set: the daemons, their descendants, processes that
        :meth:`_belongs` claims, and the descendants of those."""
        found: dict[int, psutil.Process] = {}
        roots = []
        daemons = {d.pid for d in self.procs if d.poll() is None}
        for p in psutil.process_iter():
            try:
                if p.pid in daemons or (
                        p.pid != os.getpid() and self._belongs(p)):
                    roots.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        for root in roots:
            try:
                family = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            found.update((p.pid, p) for p in family if _alive(p))
        return list(found.values())

    def logs(self) -> str:
        """The tail of every log of this set, for a failure message."""
        parts = []
        for path in sorted((self.base / "log").glob("*")):
            if path.is_file():
                parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def _before_stop(self) -> None:
        """Ask the daemons to end their work (jobs, sessions) before they are stopped."""

    def stop(self) -> list[str]:
        """Stop every process of this set by PID (SIGTERM, then SIGKILL after 10 s), remove the
        directory, and return those that survived both (none, unless something is wrong)."""
        try:
            self._before_stop()
        finally:
            for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
                procs = self.processes()
                for p in procs:
                    try:
                        p.send_signal(sig)
                    except psutil.NoSuchProcess:
                        pass
                psutil.wait_procs(procs, timeout=grace)
            for proc in self.procs:  # reap our own children
                try:
                    proc.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
        left = [describe(p) for p in self.processes()]
        if not left:
            shutil.rmtree(self.base, ignore_errors=True)
        return left


def cmdline(p: psutil.Process) -> list[str]:
    """``p``'s command line; empty for a process that is gone or a zombie."""
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def describe(p: psutil.Process) -> str:
    """``"PID command line"``, for a message."""
    return f"{p.pid} {' '.join(cmdline(p))[:120]}"


def _mentions(p: psutil.Process, prefix: str) -> bool:
    """Whether ``p`` works in, or holds a file or unix socket under, ``prefix``."""
    try:
        if p.cwd().startswith(prefix):
            return True
        if any(f.path.startswith(prefix) for f in p.open_files()):
            return True
        return any(isinstance(c.laddr, str) and c.laddr.startswith(prefix)
                   for c in p.net_connections("unix"))
    except (psutil.Error, OSError):
        return False


# ------------------------------------------------------------------------------------ Slurm


class LocalSlurm(Daemons):
    """munged, slurmctld and slurmd for this host alone, with their own configuration.

    ``env`` (``SLURM_CONF``) is what ``sbatch``, ``srun``, ``squeue`` and ``scancel`` need to
    find it; jobs inherit it (``--export=ALL``, Slurm's default).
    """

    name = "slurm"

    def __init__(self) -> None:
        super().__init__()
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.base / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}

    def _node_line(self) -> str:
        """This host as ``slurmd -C`` describes it (its memory), with :data:`NODE_CPUS` cores
        on one socket."""
        out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30,
                             check=True).stdout.splitlines()[0]
        memory = re.search(r"RealMemory=\d+", out)
        shape = (f"CPUs={NODE_CPUS} Boards=1 SocketsPerBoard=1 CoresPerSocket={NODE_CPUS} "
                 f"ThreadsPerCore=1 {memory.group(0) if memory else ''}")
        return f"NodeName={self.node} NodeAddr=127.0.0.1 {shape} State=UNKNOWN"

    def start(self) -> LocalSlurm:
        t0 = time.monotonic()
        munge = self.base / "munge"
        munge.mkdir(mode=0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = munge / "munge.socket"
        self.spawn("munged", ["munged", "--foreground", f"--socket={self.socket}",
                              f"--key-file={key}", f"--log-file={self.base / 'log/munged.log'}",
                              f"--pid-file={munge / 'munged.pid'}",
                              f"--seed-file={munge / 'munged.seed'}"])
        for d in ("state", "spool"):
            (self.base / d).mkdir()
        b = self.base
        self.conf.write_text(
            f"ClusterName=nbdisttest\n"
            f"SlurmctldHost=localhost(127.0.0.1)\n"
            f"SlurmctldPort={free_port()}\nSlurmdPort={free_port()}\n"
            f"AuthInfo=socket={self.socket}\n"
            f"StateSaveLocation={b}/state\nSlurmdSpoolDir={b}/spool\n"
            f"SlurmctldPidFile={b}/slurmctld.pid\nSlurmdPidFile={b}/slurmd.pid\n"
            f"SlurmctldLogFile={b}/log/slurmctld.log\nSlurmdLogFile={b}/log/slurmd.log\n"
            f"{_SLURM_SETTINGS}{self._node_line()}\n"
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP\n")
        wait_until(self.socket.exists, 30, "munged's socket", self.procs)
        env = {**os.environ, **self.env}
        ctld = self.spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)],
                          cwd=b, env=env)
        slurmd = self.spawn("slurmd", ["slurmd", "-D", "-N", self.node, "-f", str(self.conf)],
                            cwd=b, env=env)
        wait_until(lambda: self._node_state() == "idle", 60, "the Slurm node to be idle",
                   [ctld, slurmd])
        self._check()
        self.started_in = time.monotonic() - t0
        return self

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm command against this cluster."""
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env})

    def _node_state(self) -> str:
        r = self.run("sinfo", "-h", "-N", "-n", self.node, "-o", "%T")
        return r.stdout.strip().rstrip("*~#") if r.returncode == 0 else ""

    def _check(self) -> None:
        """A batch job that runs one job step: sbatch, the batch script, srun, slurmstepd."""
        out = self.base / "check.out"
        # Not `sbatch --wait`: it polls the job's state every few seconds (10 s for this job).
        r = self.run("sbatch", "--parsable", "--ntasks=1", f"--output={out}",
                     "--wrap", "srun hostname")
        if r.returncode == 0:
            wait_until(lambda: not self.jobs(), 60, "the check job to end")
        got = out.read_text().strip() if out.exists() else ""
        if r.returncode != 0 or got != socket.gethostname():
            raise AssertionError(f"the test Slurm does not run a job (sbatch exit "
                                 f"{r.returncode}: {r.stdout}{r.stderr}; output {got!r})")

    def jobs(self) -> list[str]:
        """IDs of this cluster's jobs still queued or running."""
        r = self.run("squeue", "-h", "-o", "%i")
        if r.returncode != 0:
            raise AssertionError(f"squeue failed: {r.stderr}")
        return r.stdout.split()

    def _belongs(self, p: psutil.Process) -> bool:
        # slurmstepd leaves slurmd's tree (job processes are its children); it keeps a socket
        # in this cluster's spool and slurmd's log open.
        return p.name().startswith("slurmstepd") and _mentions(p, str(self.base))

    def _before_stop(self) -> None:
        if any(p.poll() is None for p in self.procs[1:]):
            self.run("scancel", "--user", str(os.geteuid()))
            try:
                wait_until(lambda: not self.jobs(), 30, "the test Slurm's jobs to end")
            except AssertionError:
                pass  # stop() still ends what is left by PID


def slurm_why_not() -> Optional[str]:
    return _missing("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel",
                    "sinfo")


# -------------------------------------------------------------------------------------- SSH


class LocalSshd(Daemons):
    """An sshd on a free 127.0.0.1 port, with throwaway host and user keys, and an ssh client
    configuration (``ssh -F config``) that reaches it as :attr:`host`.

    ``netns`` runs it inside that network namespace instead, on ``address`` (the namespace's
    own), under ``hostname`` (a UTS namespace of its own): another host, as far as the
    processes its sessions start can tell.
    """

    name = "sshd"

    def __init__(self, host: str = "nbdist-ssh-test", address: str = "127.0.0.1",
                 netns: Optional[str] = None, hostname: Optional[str] = None) -> None:
        super().__init__()
        self.host, self.address, self.netns, self.hostname = host, address, netns, hostname
        self.port = free_port() if netns is None else 22
        self.config = self.base / "ssh_config"
        self.user_key = self.base / "user_key"
        self._made_privsep: Optional[Path] = None

    def start(self) -> LocalSshd:
        t0 = time.monotonic()
        b = self.base
        for key in ("host_key", "user_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "nbdist-test",
                            "-f", str(b / key)], check=True, timeout=30)
        shutil.copy(b / "user_key.pub", b / "authorized_keys")
        (b / "sshd_config").write_text(
            f"ListenAddress {self.address}\nPort {self.port}\nHostKey {b}/host_key\n"
            f"PidFile {b}/sshd.pid\nAuthorizedKeysFile {b}/authorized_keys\n"
            "PermitRootLogin prohibit-password\nPubkeyAuthentication yes\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            "StrictModes no\nX11Forwarding no\nPrintMotd no\nLogLevel INFO\n"
            # Hosts of a cluster share the notebook's environment (a shared home or image);
            # here the session's PYTHONPATH carries that, so remote workers import this copy.
            "AcceptEnv PYTHONPATH\n"
            # scp (ipyparallel sends connection files with it) speaks SFTP since OpenSSH 9
            "Subsystem sftp internal-sftp\n")
        self.config.write_text(
            f"Host {self.host}\n  HostName {self.address}\n  Port {self.port}\n"
            f"  User {_user()}\n  IdentityFile {self.user_key}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {b}/known_hosts\n  StrictHostKeyChecking no\n"
            "  BatchMode yes\n  LogLevel ERROR\n  SendEnv PYTHONPATH\n")
        # Debian's sshd needs its privilege-separation directory, made by its service unit.
        privsep = Path("/run/sshd")
        if not privsep.exists():
            privsep.mkdir(mode=0o755, parents=True)
            self._made_privsep = privsep
        sshd = shutil.which("sshd")
        assert sshd is not None  # sshd_why_not checked
        argv = [sshd, "-D", "-f", str(b / "sshd_config"), "-E", str(b / "log" / "sshd.log")]
        if self.netns is not None:
            argv = ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c",
                    f"hostname {self.hostname} && exec {' '.join(argv)}"]
        proc = self.spawn("sshd", argv)
        wait_until(lambda: _listening(self.port, self.address), 30, "sshd to listen", [proc])
        r = self.ssh("true")
        if r.returncode != 0:
            raise AssertionError(f"ssh -F {self.config} {self.host} true failed "
                                 f"({r.returncode}): {r.stderr}\n{self.logs()}")
        self.started_in = time.monotonic() - t0
        return self

    def ssh(self, *command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(["ssh", "-F", str(self.config), self.host, *command],
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def _belongs(self, p: psutil.Process) -> bool:
        # A command an ssh session started in the background outlives the session and is
        # reparented; it keeps the session's SSH_CONNECTION, which names this sshd's port.
        try:
            conn = p.environ().get("SSH_CONNECTION", "")
        except (psutil.Error, OSError):
            return False
        return conn.endswith(f" {self.address} {self.port}")

    def sessions(self) -> list[psutil.Process]:
        """Live processes of ssh sessions: everything of this set but the listening sshd."""
        daemon = {p.pid for p in self.procs}
        return [p for p in self.processes() if p.pid not in daemon]

    def stop(self) -> list[str]:
        left = super().stop()
        if self._made_privsep is not None:
            try:
                self._made_privsep.rmdir()
            except OSError:
                pass
        return left


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


def _listening(port: int, address: str = "127.0.0.1") -> bool:
    try:
        socket.create_connection((address, port), timeout=1).close()
        return True
    except OSError:
        return False


def sshd_why_not() -> Optional[str]:
    return _missing("sshd", "ssh", "ssh-keygen")


# --------------------------------------------------------------------------------- fixtures


def _serve(daemons: Daemons) -> Iterator[Daemons]:
    try:
        daemons.start()
    except BaseException:
        logs = daemons.logs()
        left = daemons.stop()
        pytest.fail(f"the test {daemons.name} did not come up; its logs:\n{logs}"
                    + (f"\nleft running: {left}" if left else ""), pytrace=False)
    try:
        yield daemons
    finally:
        left = daemons.stop()
        assert not left, f"the test {daemons.name} left processes running:\n" + "\n".join(left)


@pytest.fixture(scope="session")
def slurm_daemons() -> Iterator[LocalSlurm]:
    """A working single-host Slurm, started once per test session."""
    reason = slurm_why_not()
    if reason:
        pytest.skip(f"no test Slurm: {reason}")
    yield from _serve(LocalSlurm())


@pytest.fixture
def slurm(slurm_daemons: LocalSlurm, monkeypatch) -> Iterator[LocalSlurm]:
    """The test Slurm, with ``SLURM_CONF`` set for this test (its launchers' commands read it);
    every job of the test is cancelled, and waited for, when it ends."""
    for k, v in slurm_daemons.env.items():
        monkeypatch.setenv(k, v)
    yield slurm_daemons
    left = slurm_daemons.jobs()
    if left:
        slurm_daemons.run("scancel", *left)
        wait_until(lambda: not slurm_daemons.jobs(), 30, "the test's Slurm jobs to end")
    assert not left, f"jobs left in squeue after the test: {left}"


@pytest.fixture(scope="session")
def sshd_daemon() -> Iterator[LocalSshd]:
    """A working sshd on loopback, started once per test session."""
    reason = sshd_why_not()
    if reason:
        pytest.skip(f"no test sshd: {reason}")
    yield from _serve(LocalSshd())


@pytest.fixture
def sshd(sshd_daemon: LocalSshd) -> Iterator[LocalSshd]:
    """The test sshd; every process its sessions left running when the test ends is killed,
    by PID, and fails the test."""
    yield sshd_daemon
    left = sshd_daemon.sessions()
    names = [describe(p) for p in left]
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=10)
    assert not left, "processes of ssh sessions left after the test:\n" + "\n".join(names)


# ------------------------------------------------------------------------------------ sites

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "profiles"
PROFILES = {"slurm": "slurm-local.yaml", "ssh": "ssh-localhost.yaml"}
#: what each launcher needs of the Dask engine, and the extra of nbdist that installs it
DASK_PACKAGES = {"slurm": "dask_jobqueue", "ssh": "asyncssh"}


class Site:
    """One launcher's test daemons, as the tests need them."""

    def __init__(self, launcher: str, daemons: Daemons):
        self.launcher = launcher
        self.daemons = daemons

    def options(self, engine: str) -> dict:
        """Launcher options that reach these daemons (what a user's site config would say);
        the hosts run the notebook's own Python, nbdist's default."""
        if self.launcher != "ssh":
            return {}
        config = str(self.daemons.config)
        if engine == "ipyparallel":
            return {"ssh_args": ["-F", config], "scp_args": ["-F", config]}
        return {"connect_options": {"config": [config]}}  # asyncssh reads OpenSSH's

    def hosts(self) -> Optional[dict]:
        return {self.daemons.host: 2} if self.launcher == "ssh" else None

    def check_ranks(self, wheres: list) -> None:
        """Each rank runs under this launcher: a task of a queued Slurm job, or a process an
        ssh session of this sshd started."""
        if self.launcher == "slurm":
            jobs = self.daemons.jobs()
            for r, w in enumerate(wheres):
                assert w["SLURM_JOB_ID"] in jobs, f"rank {r} is no task of a Slurm job: {w}"
        else:
            for r, w in enumerate(wheres):
                assert (w["SSH_CONNECTION"] or "").endswith(f" {self.daemons.port}"), \
                    f"rank {r} was not started through the test sshd: {w}"

    def leftovers(self) -> list:
        """Jobs still in squeue, or processes of ssh sessions still running."""
        if self.launcher == "slurm":
            return self.daemons.jobs()
        return [describe(p) for p in self.daemons.sessions()]

    def processes(self) -> list:
        if self.launcher == "slurm":
            return self.daemons.processes()
        return self.daemons.sessions()


@pytest.fixture(params=[pytest.param("slurm", marks=pytest.mark.slurm),
                        pytest.param("ssh", marks=pytest.mark.ssh)])
def site(request, cluster_dirs) -> Site:
    """Each launcher's test daemons in turn (the test's cluster directories in a temporary
    directory of its own)."""
    return Site(request.param, request.getfixturevalue(
        "slurm" if request.param == "slurm" else "sshd"))


@pytest.fixture
def cluster_dirs(tmp_path, monkeypatch) -> Path:
    """Where nbdist puts the clusters' directories during the test (not ~/.nbdist)."""
    path = tmp_path / "clusters"
    monkeypatch.setenv("NBDIST_CLUSTER_DIR", str(path))
    return path


def write_profile(tmp: Path, site: Site, engine: str, **options) -> Path:
    """The example profile for ``site``'s launcher, on ``engine``, with the options that reach
    the test daemons (and ``options``) added to its ``resources.options``."""
    import yaml

    data = yaml.safe_load((EXAMPLES / PROFILES[site.launcher]).read_text())
    data["cluster"]["engine"] = engine
    if site.hosts():
        data["cluster"]["hosts"] = site.hosts()
    resources = data["cluster"].setdefault("resources", {})
    resources["options"] = {**resources.get("options", {}), **site.options(engine), **options}
    path = tmp / f"{site.launcher}-{engine}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def needs_engine(engine: str, launcher: str) -> None:
    if engine == "dask":
        pytest.importorskip("distributed")
        pytest.importorskip(DASK_PACKAGES[launcher],
                            reason=f"the dask engine's {launcher} launcher needs it "
                                   f"(pip install 'nbdist[{launcher}]')")


def open_listeners(procs: list) -> list:
    """The TCP listeners of ``procs`` bound to an address other than loopback."""
    import ipaddress

    pids = {p.pid: p for p in procs}
    out = []
    for c in psutil.net_connections("inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids \
                and not ipaddress.ip_address(c.laddr.ip).is_loopback:
            out.append(f"{c.laddr.ip}:{c.laddr.port} ({describe(pids[c.pid])[:90]})")
    return sorted(out)


def cluster_logs(cluster_dirs: Path) -> str:
    """The tail of every file the clusters left in their directories (kept when a start
    fails), for a failure message."""
    parts = []
    for path in sorted(cluster_dirs.rglob("*")):
        if path.is_file() and path.suffix in (".log", ".out", ".err"):
            parts.append(f"--- {path}\n{path.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)
