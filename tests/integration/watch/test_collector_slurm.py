"""A job submitted with ``sbatch`` to the suite's single-host Slurm, its ranks started by
``srun``, reports to a collector in this process as a torchrun job does: both ranks and their
steps while it runs, each rank's stack, and its end with every step, on the Slurm node.

``srun`` starts no reporting launcher: the step's first task on the node to lock the job's
directory forwards for both. The batch script runs Python of its own before ``srun`` (as
batch scripts prepare data): Slurm numbers it too (``SLURM_PROCID=0``), and it must not count
as a rank. The start-up hook is installed in a site directory of the test's own, as in
``test_collector_torchrun.py`` (this checkout is an editable install, which has no hook)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from realclusters import free_port, wait_until

from nbdist.watch.collector import Collector
from nbdist.watch.watched import WatchedJob

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[3]
STEPS = 24  # optimizer steps per rank
HELD_AT = 8  # rank 1 waits at this step for the test to see the job live

# A script written for srun: its rank and world size are Slurm's, its group's address is
# given on the command line (srun sets no MASTER_ADDR).
TRAIN = textwrap.dedent(f"""
    import datetime, os, sys, time
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    go, port = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
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
    mods = sorted(m for m in sys.modules if m.startswith("nbdist"))
    sys.stdout.write(f"NBDIST_MODULES rank {{rank}} {{mods}}\\n")
    sys.stdout.flush()
""")
BACKWARD_LINE = next(i for i, line in enumerate(TRAIN.splitlines(), 1)
                     if line.strip() == "loss.backward()")


def _sbatch(slurm, tmp_path, site_dir, line, go):
    """Submit the batch job with ``line`` in its environment; its job id."""
    (tmp_path / "train.py").write_text(TRAIN)
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"{sys.executable} -c 'print(\"prepared\")'\n"
        f"srun --ntasks=2 {sys.executable} train.py {go} {free_port()}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBDIST_ATTACH")}
    env.update(slurm.env, PYTHONPATH=f"{site_dir}{os.pathsep}{REPO}", NBDIST_ATTACH=line)
    r = subprocess.run(["sbatch", "--parsable", "--ntasks=2", f"--chdir={tmp_path}",
                        f"--output={tmp_path / 'job.out'}", str(script)],
                       env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def _output(tmp_path) -> str:
    out = tmp_path / "job.out"
    return out.read_text() if out.exists() else "(no output yet)"


def test_an_sbatch_job_of_srun_ranks_reports_both_ranks_live_and_ends_finished(
        slurm, tmp_path, site_dir):
    collector = Collector()
    go = tmp_path / "go"
    job_id = _sbatch(slurm, tmp_path, site_dir, collector.address.line, go)
    try:
        def live():
            assert job_id in slurm.jobs(), "the job ended first:\n" + _output(tmp_path)
            recs = collector.jobs.records()
            return len(recs) == 1 and len(recs[0].steps) == 2 and min(recs[0].steps.values())
        wait_until(live, 180, "both ranks' first steps")
        (rec,) = collector.jobs.records()
        assert rec.state == "running" and rec.world_size == 2, rec
        assert rec.key == f"slurm-{job_id}.0"  # the srun step, as sacct names it
        assert all(1 <= n <= HELD_AT for n in rec.steps.values()), rec
        # the ranks ran on the Slurm node: this host
        assert rec.hosts == (socket.gethostname(),) and slurm.node == rec.hosts[0].split(".")[0]
        job = WatchedJob(collector.jobs, collector.jobs.get(rec.id), collector.stacks)
        stacks: dict = {}

        def held():
            stacks.update(job.stacks(timeout=5))
            return "loss.backward()" in stacks.get(0, "") and "sleep" in stacks.get(1, "")
        wait_until(held, 90, "rank 0 in its backward and rank 1 asleep")
        assert stacks[1].rstrip().endswith("time.sleep(0.05)"), stacks[1]
        assert (f'File "{tmp_path / "train.py"}", line {BACKWARD_LINE}, in <module>\n'
                "    loss.backward()") in stacks[0], stacks[0]
        go.touch()
        wait_until(lambda: job_id not in slurm.jobs(), 180, "the Slurm job to end")
        out = _output(tmp_path)
        assert "prepared" in out and out.count("nbdist.agent.rank") == 2, out
        end = time.monotonic() + 30
        while collector.jobs.records()[0].state == "running":
            assert time.monotonic() < end, collector.jobs.records()
            time.sleep(0.05)
        (rec,) = collector.jobs.records()  # the batch script's own Python was no rank
        assert rec.state == "finished", (rec, out)
        assert rec.steps == {0: STEPS, 1: STEPS}
        assert rec.dropped == 0 and rec.error is None
        assert collector.accepted == 1  # one connection for the node, the elected rank's
    finally:
        if job_id in slurm.jobs():
            slurm.run("scancel", job_id)
            wait_until(lambda: job_id not in slurm.jobs(), 60, "the cancelled job to end")
        collector.close()
