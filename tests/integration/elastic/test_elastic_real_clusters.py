"""Elastic training where users run it: a rank lost under a real Slurm, a host lost over SSH.

Under Slurm, a rank's job is lost mid-training inside ``nbdist.elastic.run`` (on ipyparallel
the rank's engine, a task of the engines' job, is SIGKILLed; on Dask, where each rank is a job
of its own whose nanny would restart a killed worker in place, the job's nanny and worker are
SIGKILLed, as a node failure would take them): the survivors heal, a replacement starts as a
NEW Slurm job and joins, and the result equals uninterrupted training (the ground truth of
``elastic_training.py``).

Over SSH, two hosts are network namespaces with their own hostname and sshd; every process of
one of them is killed mid-training (its sshd too): the survivor carries on at world size 1,
names the lost host in the run's notes, and the result is still exact.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
import yaml
from elastic_training import SETUP, STEPS, assert_trained_like_reference
from realclusters import (
    LocalSlurm,
    LocalSshd,
    Site,
    cluster_logs,
    needs_engine,
    wait_until,
    write_profile,
)

import nbdist

pytestmark = pytest.mark.timeout(300)

#: how a rank takes its own job down with it (see the module's text)
KILL_JOB = {"ipyparallel": "os.kill(os.getpid(), 9)",
            "dask": "os.kill(os.getppid(), 9); os.kill(os.getpid(), 9)"}
_JOB = "import os\njob = os.environ.get('SLURM_JOB_ID')"


def _setup(engine: str) -> str:
    assert "os.kill(os.getpid(), 9)" in SETUP
    return "USE_DDP = False\n" + SETUP.replace("os.kill(os.getpid(), 9)", KILL_JOB[engine])


@pytest.mark.slurm
@pytest.mark.parametrize("engine", ["ipyparallel", "dask"])
def test_a_rank_lost_under_slurm_is_replaced_by_a_new_job(slurm: LocalSlurm, engine, tmp_cwd,
                                                          cluster_dirs, capsys):
    needs_engine(engine, "slurm")
    s = nbdist.start(profile=str(write_profile(tmp_cwd, Site("slurm", slurm), engine)))
    try:
        s.run_cell(_setup(engine) + "\n" + _JOB, output="quiet")
        before = {s.pull("job", rank=r) for r in range(2)}
        assert before <= set(slurm.jobs())
        flag = tmp_cwd / "killed"
        t0 = time.monotonic()
        s.run_cell(f"train(state, {STEPS}, kill=[(5, 1, {str(flag)!r})])\n" + _JOB)
        healed = time.monotonic() - t0
        out = capsys.readouterr().out
        assert flag.exists()
        assert "rank 1 on " in out and " died" in out and "world 2 -> 1" in out, out
        assert "a replacement worker joined" in out and "world 1 -> 2" in out, out
        after = {s.pull("job", rank=r) for r in range(2)}
        new = after - before
        assert len(new) == 1 and new <= set(slurm.jobs()), (before, after, slurm.jobs())
        assert_trained_like_reference(s)
        print(f"slurm x {engine}: lost, healed and rejoined by job {new.pop()} in "
              f"{healed:.1f} s")
    finally:
        s.stop()
    wait_until(lambda: not slurm.jobs(), 30, "no job left after stop()")


# --------------------------------------------------------------------------- a host lost

#: a cell's companion on every rank: its host's training step, in a file named after the host
_PROGRESS = """
import pathlib, socket, threading, time
def _report(where=pathlib.Path({where!r})):
    while True:
        (where / socket.gethostname()).write_text(str(state.step))
        time.sleep(0.05)
threading.Thread(target=_report, daemon=True).start()
"""


@pytest.fixture
def hosts(net):
    """An sshd in each network-namespace host of ``net`` (nethosts.py), under the host's
    own name, and one ssh client configuration that reaches both (for each test: a test loses
    one of them)."""
    sshds = [LocalSshd(host=f"nbdist-{h.hostname}", address=h.ip, netns=h.ns,
                       hostname=h.hostname) for h in net.hosts]
    started = []
    try:
        for d in sshds:
            d.start()
            started.append(d)
        config = started[0].base / "both_hosts"
        config.write_text("".join(d.config.read_text() for d in started))
        yield sshds, config
    finally:
        left = [p for d in started for p in d.stop()]
        assert not left, f"the hosts' sshds left processes: {left}"


@pytest.mark.ssh
@pytest.mark.parametrize("engine", ["ipyparallel", "dask"])
def test_a_lost_host_leaves_the_survivor_training(hosts, net, engine, tmp_cwd,
                                                  cluster_dirs, capsys):
    needs_engine(engine, "ssh")
    sshds, config = hosts
    options = ({"ssh_args": ["-F", str(config)], "scp_args": ["-F", str(config)]}
               if engine == "ipyparallel" else {"connect_options": {"config": [str(config)]}})
    profile = tmp_cwd / "two-hosts.yaml"
    profile.write_text(yaml.safe_dump({
        "cluster": {"engine": engine, "launcher": "ssh", "listen": net.gateway,
                    "hosts": {d.host: 1 for d in sshds}, "resources": {"options": options}},
        "runtime": {"device": "cpu", "dist_backend": "gloo", "threads": 1, "timeout": 120}}))
    progress = tmp_cwd / "progress"
    progress.mkdir()
    try:
        s = nbdist.start(profile=str(profile))
    except BaseException:
        print(cluster_logs(cluster_dirs))
        raise
    killed: list[str] = []
    try:
        s.run_cell("USE_DDP = False\n" + SETUP + "\nimport socket\nhost = socket.gethostname()",
                   output="quiet")
        names = [s.pull("host", rank=r) for r in range(2)]
        assert sorted(names) == sorted(h.hostname for h in net.hosts)
        lost = next(h for h in net.hosts if h.hostname == names[1])

        def kill_host() -> None:
            mark = progress / lost.hostname
            wait_until(lambda: mark.exists() and int(mark.read_text() or 0) >= 10, 120,
                       "the training to reach step 10 on the host to lose")
            for pid in subprocess.run(["ip", "netns", "pids", lost.ns], capture_output=True,
                                      text=True).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass

        killer = threading.Thread(target=kill_host, daemon=True)
        killer.start()
        t0 = time.monotonic()
        s.run_cell(_PROGRESS.format(where=str(progress)) + f"train(state, {STEPS}, pause=0.1)")
        took = time.monotonic() - t0
        killer.join(timeout=5)
        out = capsys.readouterr().out
        assert killed, "the host was not lost"
        assert f"rank 1 on {lost.hostname}" in out and " died" in out, out
        assert "world 2 -> 1" in out, out
        notes = "\n".join(s.last_run.notes)
        assert f"on {lost.hostname}" in notes, notes
        assert_trained_like_reference(s)
        print(f"ssh x {engine}: host {lost.hostname} lost ({len(killed)} processes killed); "
              f"training finished in {took:.1f} s")
    finally:
        s.stop()
    survivor = next(d for d in sshds if d.hostname != lost.hostname)
    wait_until(lambda: not survivor.sessions(), 30, "nothing left on the surviving host")
