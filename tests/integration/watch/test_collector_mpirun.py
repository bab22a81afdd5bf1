"""A job started by Open MPI's ``mpirun -np 2``, with the line ``%nbdist attach`` prints in its
environment, reports to a collector in this process as a torchrun job does: both ranks and
their steps while it runs, and its end with every step, or failed with the rank's error.

``mpirun`` starts no reporting launcher: the ranks know themselves from Open MPI's variables
(``OMPI_COMM_WORLD_RANK``/``SIZE``), the job from the PMIx namespace they share, and the
first rank on the host to lock the job's directory forwards for both, as under ``srun``. The
script is written as MPI-launched PyTorch scripts are: its rank and world size are Open MPI's,
and it gives torch's rendezvous its address itself. The start-up hook is installed in a site
directory of the test's own, as in ``test_collector_torchrun.py`` (this checkout is an
editable install, which has no hook)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from realclusters import free_port, wait_until
from torchrun_runs import finish, kill_session

from nbdist.watch.collector import Collector

MPIRUN = shutil.which("mpirun")
pytestmark = [pytest.mark.timeout(400),
              pytest.mark.skipif(MPIRUN is None, reason="needs Open MPI's mpirun "
                                 "(Debian's openmpi-bin)")]

REPO = Path(__file__).resolve().parents[3]
STEPS = 24  # optimizer steps per rank
HELD_AT = 8  # rank 1 waits at this step for the test to see the job live

TRAIN = textwrap.dedent(f"""
    import datetime, os, sys, time
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    go, port = sys.argv[1], sys.argv[2]
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range({STEPS}):
        if i == int(os.environ.get("FAIL_AT", "-1")) and rank == 1:
            raise ValueError(f"bad batch at step {{i}}")
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
    mods = sorted(m for m in sys.modules if m.startswith("nbdist"))
    sys.stdout.write(f"NBDIST_MODULES rank {{rank}} {{mods}}\\n")
    sys.stdout.flush()
""")


def _mpirun(tmp_path, site_dir, line, go, **extra):
    """``mpirun -np 2 python train.py`` with ``line`` in the environment, exported to the
    ranks as a user does (``-x``), in a process session of its own."""
    (tmp_path / "train.py").write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBDIST_ATTACH")}
    env.update(extra, PYTHONPATH=f"{site_dir}{os.pathsep}{REPO}", NBDIST_ATTACH=line)
    # as root, Open MPI wants to be told; --oversubscribe: a host with fewer cores than ranks
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", "2",
           "-x", "NBDIST_ATTACH", "-x", "PYTHONPATH", *(a for k in extra for a in ("-x", k)),
           sys.executable, "train.py", str(go), str(free_port())]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _ended(collector, timeout=30):
    end = time.monotonic() + timeout
    while not collector.jobs.records() or collector.jobs.records()[0].state == "running":
        assert time.monotonic() < end, collector.jobs.records()
        time.sleep(0.05)
    (rec,) = collector.jobs.records()
    return rec


def test_an_mpirun_job_reports_both_ranks_live_and_ends_finished_with_every_step(
        tmp_path, site_dir):
    collector = Collector()
    go = tmp_path / "go"
    proc = _mpirun(tmp_path, site_dir, collector.address.line, go)
    try:
        def live():
            recs = collector.jobs.records()
            return len(recs) == 1 and len(recs[0].steps) == 2 and min(recs[0].steps.values())
        wait_until(live, 180, "both ranks' first steps", watch=[proc])
        (rec,) = collector.jobs.records()
        assert rec.state == "running" and rec.world_size == 2, rec
        assert rec.key.startswith("mpirun-"), rec  # the namespace both ranks share
        assert all(1 <= n <= HELD_AT for n in rec.steps.values()), rec
        assert rec.hosts == (socket.gethostname(),)
        go.touch()
        code, out = finish(proc)
        assert code == 0, out
        assert out.count("nbdist.agent.rank") == 2, out  # both measured by the agent
        rec = _ended(collector)
        assert rec.state == "finished", (rec, out)
        assert rec.steps == {0: STEPS, 1: STEPS}
        assert rec.dropped == 0 and rec.error is None
        assert collector.accepted == 1  # one connection for the node, the elected rank's
    finally:
        if proc.poll() is None:
            kill_session(proc)
        collector.close()


def test_a_rank_that_raises_under_mpirun_fails_the_job_with_its_error(tmp_path, site_dir):
    collector = Collector()
    go = tmp_path / "go"
    go.touch()
    try:
        code, out = finish(_mpirun(tmp_path, site_dir, collector.address.line, go,
                                    FAIL_AT="3"))
        assert code != 0 and "ValueError: bad batch at step 3" in out, out
        rec = _ended(collector)
        assert rec.state == "failed", (rec, out)
        assert rec.error == "ValueError: bad batch at step 3"
        assert rec.steps[1] == 3  # the steps it took before the error
    finally:
        collector.close()
