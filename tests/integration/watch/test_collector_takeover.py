"""Ranks started as ``python -m nbdist.agent`` without a launcher that reports (as ``srun``
or ``mpirun`` start them) elect one of their node's ranks to forward; when that rank dies,
another rank of the node takes over its forwarding, and the notebook follows the job on.
Real processes: two ranks of one job, the forwarding one SIGKILLed mid-job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nbdist.agent.hook import node_directory
from nbdist.watch.collector import Collector

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[3]
STEPS = 30

TRAIN = textwrap.dedent(f"""
    import os, sys, time
    import torch
    rank = int(os.environ["RANK"])
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range({STEPS}):
        if i == 5:  # the test says when: both ranks seen, then the forwarder's death seen
            wait_for = sys.argv[1] if rank == 0 else sys.argv[2]
            deadline = time.time() + 120
            while not os.path.exists(wait_for) and time.time() < deadline:
                time.sleep(0.05)
            if rank == 0:
                os.kill(os.getpid(), 9)  # SIGKILL
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.02)
""")


def _until(cond, timeout, procs):
    end = time.monotonic() + timeout
    while not cond():
        for p in procs:
            assert p.poll() is None or p.returncode == -signal.SIGKILL, p.returncode
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.05)


def test_another_rank_takes_over_when_the_forwarding_rank_dies(tmp_path):
    collector = Collector()
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    kill, go_on = tmp_path / "kill", tmp_path / "go-on"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBDIST_ATTACH")}
    env.update(PYTHONPATH=str(REPO), NBDIST_ATTACH=collector.address.line, WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(collector.port))

    def rank(r):
        return subprocess.Popen([sys.executable, "-m", "nbdist.agent", str(script), str(kill),
                                 str(go_on)], env={**env, "RANK": str(r)}, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    procs = []
    try:
        procs.append(rank(0))  # it locks the node's directory first: the forwarder
        _until(lambda: collector.accepted == 1 and collector.jobs.records(), 120, procs)
        procs.append(rank(1))
        _until(lambda: (recs := collector.jobs.records()) and max(recs[0].steps.values()) >= 1
               and len(collector.jobs.get("1").ranks) == 2, 120, procs)
        kill.touch()  # rank 0 SIGKILLs itself: its forwarder and connection go with it
        assert procs[0].wait(timeout=60) == -signal.SIGKILL
        _until(lambda: collector.accepted == 2, 30, procs)  # rank 1's forwarder connected
        assert collector.jobs.records()[0].state == "running"  # carried on, not lost
        go_on.touch()
        went_on = time.time()
        out, _ = procs[1].communicate(timeout=120)
        assert procs[1].returncode == 0, out
        end = time.monotonic() + 30
        while collector.jobs.records()[0].state == "running":
            assert time.monotonic() < end, collector.jobs.records()
            time.sleep(0.05)
        (rec,) = collector.jobs.records()
        # every step of rank 1, each once (the new forwarder read its files from the start)
        assert rec.steps[1] == STEPS and rec.steps[0] <= 5, rec
        assert rec.state == "lost"  # rank 0 ended without saying how
        notes = collector.jobs.get(rec.id).notes
        assert [n for n in notes if "ended without saying how" in n] == [
            f"rank 0 (pid {procs[0].pid} on {rec.hosts[0]}) ended without saying how: killed, "
            "or lost"], notes
        # the view followed rank 1 to its end, never stopped at the forwarder's death
        rows = {r.rank: r for r in collector.jobs.get(rec.id).snapshot().ranks}
        assert (rows[1].state.value, rows[1].error) == ("done", None), rows[1]
        assert collector.jobs.get(rec.id).run.ended > went_on  # it ended with rank 1
        assert not os.path.exists(node_directory(collector.address, env))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        collector.close()
