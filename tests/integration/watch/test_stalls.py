"""The hang doctor on a real ``torchrun --standalone --nproc_per_node=2`` job watched from
this process: rank 1 sleeps inside a step while rank 0 waits in the backward's all-reduce. The
verdict names rank 1 and the line of the script it sleeps at, rank 0's collective and line;
the stacks taken now agree; once rank 1 goes on, the verdict goes and the job finishes with
every step. The job's fixtures and helpers are those of :mod:`test_collector_torchrun`."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from torchrun_runs import finish, kill_session

from nbdist.watch.collector import Collector
from nbdist.watch.watched import WatchedJob


def _helpers():
    """The torchrun job tests' module, for its fixtures and helpers (tests are imported by
    path, not as a package)."""
    path = Path(__file__).with_name("test_collector_torchrun.py")
    spec = importlib.util.spec_from_file_location("_collector_torchrun", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


jobs = _helpers()

pytestmark = pytest.mark.timeout(300)

STEPS = 12
SLEEP_AT = 5  # rank 1 sleeps in this step until the test wakes it

TRAIN = textwrap.dedent(f"""
    import datetime, os, signal, time
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP


    class Woken(Exception):
        pass


    def wake(signum, frame):
        raise Woken


    signal.signal(signal.SIGUSR1, wake)
    rank = int(os.environ["RANK"])
    # longer than rank 0's wait for rank 1 (a gloo collective times out with the group)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=240))
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range({STEPS}):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        if i == {SLEEP_AT} and rank == 1:
            try:
                time.sleep(200)
            except Woken:
                pass
        loss.backward()
        opt.step()
    dist.destroy_process_group()
""")

SLEEP_LINE = next(i for i, line in enumerate(TRAIN.splitlines(), 1)
                  if line.strip() == "time.sleep(200)")
BACKWARD_LINE = next(i for i, line in enumerate(TRAIN.splitlines(), 1)
                     if line.strip() == "loss.backward()")


def test_rank_1_sleeping_in_a_step_is_named_with_the_scripts_line(tmp_path, site_dir):
    collector = Collector()
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script)],
        cwd=tmp_path, env=jobs._env(site_dir, collector.address.line), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        def stalled():
            recs = collector.jobs.records()
            # (a verdict may come earlier: on a loaded machine a rank can be ten seconds
            # late to DDP's first collective)
            return bool(recs) and f"train.py:{SLEEP_LINE}" in (recs[0].stall or "")
        jobs._until(stalled, 120, proc)
        (rec,) = collector.jobs.records()
        assert rec.state == "running", rec
        # each rank took SLEEP_AT steps; counts are read at a moment common to the ranks, so
        # a rank's last step may not be counted yet
        assert all(SLEEP_AT - 1 <= n <= SLEEP_AT for n in rec.steps.values()), rec
        head, *where = rec.stall.splitlines()
        # rank 0 waits in the all-reduce its backward started; rank 1 never reached it
        assert "rank 0 waits in all_reduce" in head and "rank 1 never reached it" in head, head
        assert f"at train.py:{BACKWARD_LINE}: loss.backward()" in where[0], where
        assert where[0].startswith("rank 0: waiting in all_reduce"), where
        assert where[1].startswith(f"rank 1: in time.sleep(200) at train.py:{SLEEP_LINE}"), where
        assert "never reached the all_reduce" in where[1], where
        assert ", stalled" in rec.line()
        job = WatchedJob(collector.jobs, collector.jobs.get(rec.id), collector.stacks)
        # the text view says the same, and the rank's row says who held the others
        text = job.summary()
        # the same verdict, its seconds counted again when the summary was made
        since, _, verdict = head.partition(" (stall threshold")
        assert since.startswith("no step or collective completed for "), head
        assert "hang doctor: no step or collective completed for " in text, text
        assert f"(stall threshold{verdict}" in text and where[1] in text, text
        assert f"held the others: in time.sleep(200) at train.py:{SLEEP_LINE}" in text, text
        # its stack, taken now, agrees: time.sleep at that line of the script
        stack = job.stacks(rank=1)[1]
        assert (f'File "{script}", line {SLEEP_LINE}, in <module>\n    time.sleep(200)'
                in stack), stack
        assert stack.rstrip().endswith("time.sleep(200)"), stack
        os.kill(collector.jobs.get(rec.id).ranks[1].pid, signal.SIGUSR1)  # rank 1 goes on
        code, out = finish(proc)
        assert code == 0, out
        end_by = time.monotonic() + 30  # the job's last frames are on their way
        while collector.jobs.records()[0].state == "running":
            assert time.monotonic() < end_by, collector.jobs.records()
            time.sleep(0.05)
        (rec,) = collector.jobs.records()
        assert rec.state == "finished" and rec.steps == {0: STEPS, 1: STEPS}, rec
        assert rec.stall is None  # it went on: no verdict stands
    finally:
        if proc.poll() is None:
            kill_session(proc)
        collector.close()
