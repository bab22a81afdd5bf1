"""Elastic training where users run it: a rank lost under a real Slurm, a host lost over SSH.

Under Slurm, a rank's job is lost mid-training inside ``nbdist.elastic.run`` (on ipyparallel
the rank's engine, a task of the engines' job, is SIGKILLed; on Dask, where each rank is a job
of its own whose nanny would restart a killed worker in place, the job's nanny and worker are
SIGKILLed, as a node failure would take them): the survivors heal, a replacement starts as a
NEW Slurm job and joins, and the result equals uninterrupted training (the ground truth of
``test_elastic.py``).

Over SSH, two hosts are network namespaces with their own hostname and sshd; every process of
one of them is killed mid-training (its sshd too): the survivor carries on at world size 1,
names the lost host in the run's notes, and the result is still exact.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from realclusters import LocalSlurm, Site, needs_engine, wait_until, write_profile
from test_elastic import SETUP, STEPS, assert_trained_like_reference

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
