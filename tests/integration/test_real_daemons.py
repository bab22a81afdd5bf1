"""The test Slurm and sshd themselves: they work, listen on loopback only, and leave nothing.

Each test starts its own daemons (not the session's), gives them work that outlives its
command (a running batch job; a command an ssh session left in the background), stops them,
and checks that no process they started survives.
"""

from __future__ import annotations

import os

import psutil
import pytest
from realclusters import LocalSlurm, LocalSshd, slurm_why_not, sshd_why_not, wait_until

pytestmark = pytest.mark.timeout(180)


def _listeners(procs: list[psutil.Process]) -> set[str]:
    """Addresses the given processes listen on (TCP)."""
    pids = {p.pid for p in procs}
    return {c.laddr.ip for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in pids}


def _gone(pids: set[int]) -> list[int]:
    return [pid for pid in pids if psutil.pid_exists(pid)
            and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slurm
def test_slurm_runs_jobs_on_loopback_and_stops_everything_it_started():
    reason = slurm_why_not()
    if reason:
        pytest.skip(reason)
    slurm = LocalSlurm()
    try:
        slurm.start()  # includes its own check: a batch job that ran a step
        print(f"test Slurm up in {slurm.started_in:.1f} s")
        r = slurm.run("sbatch", "--parsable", "--output=/dev/null", "--wrap", "srun sleep 600")
        assert r.returncode == 0, r.stderr
        job = r.stdout.strip().split(";")[0]
        sleeper = []

        def running() -> bool:
            sleeper[:] = [p for p in slurm.processes() if p.name() == "sleep"]
            return bool(sleeper)

        wait_until(running, 30, "the job's step to run")
        assert slurm.jobs() == [job]
        procs = slurm.processes()
        names = {p.name() for p in procs}
        assert {"munged", "slurmctld", "slurmd", "sleep"} <= names, names
        assert any(n.startswith("slurmstepd") for n in names), names
        assert _listeners(procs) == {"127.0.0.1"}, "a Slurm daemon listens beyond loopback"
        pids = {p.pid for p in procs}
        base = slurm.base
    except BaseException:
        print(slurm.logs())
        slurm.stop()
        raise
    left = slurm.stop()
    assert not left
    assert not _gone(pids), "processes of the stopped Slurm still run"
    assert not base.exists()


@pytest.mark.ssh
def test_sshd_runs_commands_on_loopback_and_stops_every_session():
    reason = sshd_why_not()
    if reason:
        pytest.skip(reason)
    sshd = LocalSshd()
    try:
        sshd.start()  # includes its own check: ssh -F config host true
        print(f"test sshd up in {sshd.started_in:.1f} s")
        assert sshd.ssh("echo", "$SSH_CONNECTION").stdout.split()[-2:] == \
            ["127.0.0.1", str(sshd.port)]
        # A command left running by a session that ended: reparented, outside sshd's tree.
        r = sshd.ssh("nohup setsid sleep 600 >/dev/null 2>&1 < /dev/null & echo $!")
        assert r.returncode == 0, r.stderr
        wait_until(lambda: any(p.name() == "sleep" for p in sshd.sessions()), 30,
                   "the background command to show as the session's")
        procs = sshd.processes()
        assert _listeners(procs) == {"127.0.0.1"}, "sshd listens beyond loopback"
        pids = {p.pid for p in procs}
        assert os.getpid() not in pids
        base = sshd.base
    except BaseException:
        print(sshd.logs())
        sshd.stop()
        raise
    left = sshd.stop()
    assert not left
    assert not _gone(pids), "processes of the stopped sshd still run"
    assert not base.exists()
