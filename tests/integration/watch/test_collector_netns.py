"""A torchrun job on another host reports to the notebook's collector across the network: the
host is a network and UTS namespace of its own (``nethosts.py``), reached over a bridge, and
the collector listens on this host's address there because ``--listen`` names it. The
notebook sees the job's ranks, their steps while it runs, a rank's stack and the job's end,
with ``hosts`` naming the other host; a job whose line carries another token is refused, and
trains and finishes as without a notebook. Needs root and iproute2 (the ``net`` fixture skips
without them)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from nethosts import Host, Net, wait_until

from nbdist.agent import wire
from nbdist.watch import collector as attaching
from nbdist.watch.watched import WatchedJob

pytestmark = pytest.mark.timeout(400)

REPO = Path(__file__).resolve().parents[3]
STEPS = 24  # optimizer steps per rank
HELD_AT = 8  # rank 1 waits at this step for the test to see the job live

TRAIN = textwrap.dedent(f"""
    import datetime, os, socket, sys, time
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    go, rank = sys.argv[1], int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range({STEPS}):
        if i == {HELD_AT} and rank == 1:  # rank 0 waits in the all-reduce
            deadline = time.time() + 120
            while not os.path.exists(go) and time.time() < deadline:
                time.sleep(0.05)
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.01)
    dist.destroy_process_group()
    sys.stdout.write(f"TRAINED rank {{rank}} on {{socket.gethostname()}}\\n")
    sys.stdout.flush()
""")


@pytest.fixture
def listening(net: Net):
    """The kernel's collector, asked to listen on this host's address on the bridge."""
    collector = attaching.attach(listen=f"{net.gateway}:0")
    try:
        yield collector
    finally:
        collector.close()


def _torchrun(net: Net, host: Host, tmp_path: Path, site_dir: Path, line: str,
              go: Path) -> subprocess.Popen:
    """``torchrun --standalone --nproc_per_node=2`` on ``host``, ``line`` in its environment.
    The host's name resolves nowhere (no DNS knows it): torchrun is given its address, and
    gloo its interface, as on a cluster whose names do not resolve."""
    (tmp_path / "train.py").write_text(TRAIN)
    return net.spawn(["env", f"PYTHONPATH={site_dir}{os.pathsep}{REPO}", f"{wire.ENV}={line}",
                      f"GLOO_SOCKET_IFNAME={host.ifname}",
                      sys.executable, "-m", "torch.distributed.run", "--standalone",
                      f"--local-addr={host.ip}", "--nproc_per_node=2",
                      str(tmp_path / "train.py"), str(go)],
                     host=host, log=tmp_path / "job.log")


def _wait(cond, timeout: float, what: str, proc: subprocess.Popen, tmp_path: Path) -> None:
    try:
        wait_until(cond, timeout, what, proc)
    except AssertionError as exc:
        out = (tmp_path / "job.log").read_text()
        raise AssertionError(f"{exc}; the job's output:\n{out}") from None


def _kill(proc: subprocess.Popen) -> None:
    """End the job: its launcher and its ranks (each rank leads a session of its own)."""
    try:
        family = [psutil.Process(proc.pid)]
        family += family[0].children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)


def _finish(proc: subprocess.Popen, tmp_path: Path, timeout: float = 240) -> tuple[int, str]:
    """The job's exit status and output; a job past ``timeout`` seconds is killed."""
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            _kill(proc)
    return proc.returncode, (tmp_path / "job.log").read_text()


def test_a_job_on_another_host_is_watched_through_the_interface_listen_names(
        net, listening, tmp_path, site_dir):
    assert listening.line.startswith(f"NBDIST_ATTACH=tcp://{net.gateway}:")
    host = net.hosts[0]
    go = tmp_path / "go"
    proc = _torchrun(net, host, tmp_path, site_dir, listening.address.line, go)
    try:
        def live():
            recs = listening.jobs.records()
            return recs and len(recs[0].steps) == 2 and min(recs[0].steps.values()) >= 1
        _wait(live, 180, "both ranks' first steps", proc, tmp_path)
        (rec,) = listening.jobs.records()
        assert rec.state == "running" and rec.world_size == 2, rec
        assert all(1 <= n <= HELD_AT for n in rec.steps.values()), rec
        assert rec.hosts == (host.hostname,)  # the other host's name, not this one's
        job = WatchedJob(listening.jobs, listening.jobs.get(rec.id), listening.stacks)
        stack: dict = {}

        def asleep():  # the request crosses to the other host and the answer comes back
            stack.update(job.stacks(rank=1, timeout=5))
            return stack.get(1, "").rstrip().endswith("time.sleep(0.05)")
        _wait(asleep, 90, "rank 1's stack in its sleep", proc, tmp_path)
        go.touch()
        code, out = _finish(proc, tmp_path)
        assert code == 0, out
        assert out.count("TRAINED rank") == 2 and f"on {host.hostname}" in out, out
        end = time.monotonic() + 30
        while listening.jobs.records()[0].state == "running":
            assert time.monotonic() < end, listening.jobs.records()
            time.sleep(0.05)
        (rec,) = listening.jobs.records()
        assert rec.state == "finished" and rec.steps == {0: STEPS, 1: STEPS}, rec
        assert rec.hosts == (host.hostname,) and rec.dropped == 0
        assert listening.accepted == 1 and listening.refused == 0
    finally:
        if proc.poll() is None:
            _kill(proc)


def test_a_job_with_another_token_is_refused_and_trains_on(net, listening, tmp_path, site_dir):
    wrong = listening.address._replace(token=wire.new_token()).line
    go = tmp_path / "go"
    go.touch()
    proc = _torchrun(net, net.hosts[1], tmp_path, site_dir, wrong, go)
    code, out = _finish(proc, tmp_path)
    assert code == 0 and out.count("TRAINED rank") == 2, out
    assert "Traceback" not in out, out
    assert listening.refused >= 1  # its forwarder did reach the collector, and was refused
    assert listening.accepted == 0 and listening.jobs.records() == []
