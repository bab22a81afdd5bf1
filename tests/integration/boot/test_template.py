"""Workers forked from the host's worker template, on both engines: they train to the ground
truth, take interrupts, are reported at once when killed (with the signal), grow the cluster
by forks too, and a template that is not safe to fork hands over to fresh processes, saying
why. (No orphans after the kernel's SIGKILL: test_orphans.py, with templates on by default.)
"""

from __future__ import annotations

import _thread
import os
import signal
import textwrap
import threading

import psutil
import pytest
from clusters import ENGINES, check_ddp_matches_union_batch, start_session

from nbdist.backends.base import poll_until
from nbdist.backends.dask.forkserver import DASK_PRELOAD
from nbdist.backends.ipyparallel.template import IPP_MODULES
from nbdist.boot import template
from nbdist.errors import CellInterrupted, DistributedError

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not template.supported(), reason="worker templates need Linux")]

#: a piece of each template's command line: ours (ipyparallel), Python's forkserver (Dask)
TEMPLATE_CMD = {"ipyparallel": "nbdist.runtime.boot.template",
                "dask": "multiprocessing.forkserver"}


def _parent_cmd(pid: int) -> str:
    return " ".join(psutil.Process(psutil.Process(pid).ppid()).cmdline())


def _worker_pids(s) -> list[int]:
    return [row.pid for row in s.status().rows]


@pytest.mark.parametrize("engine", ENGINES)
def test_forked_workers_train_to_the_ground_truth_and_scale_by_forking(engine):
    s = start_session(engine)
    try:
        pids = _worker_pids(s)
        parents = {psutil.Process(pid).ppid() for pid in pids}
        assert len(parents) == 1, "one template per host"
        assert all(TEMPLATE_CMD[engine] in _parent_cmd(pid) for pid in pids)
        if engine == "ipyparallel":  # the rendezvous store forks from it too
            assert TEMPLATE_CMD[engine] in _parent_cmd(s.membership.store.pid)
        check_ddp_matches_union_batch(s)
        s.scale(3)
        new = set(_worker_pids(s)) - set(pids)
        assert len(new) == 1 and {psutil.Process(p).ppid() for p in new} == parents
        check_ddp_matches_union_batch(s)
    finally:
        s.stop()


@pytest.mark.parametrize("engine", ENGINES)
def test_an_interrupt_reaches_the_cell_on_forked_workers(engine, tmp_path):
    s = start_session(engine)
    marker = tmp_path / "running"
    try:
        def press_stop() -> None:
            poll_until(marker.exists, 60)
            _thread.interrupt_main()  # what the kernel's stop button does

        helper = threading.Thread(target=press_stop, daemon=True)
        helper.start()
        with pytest.raises(CellInterrupted):
            s.run_cell(textwrap.dedent(f"""
                import pathlib, time
                pathlib.Path({str(marker)!r}).touch()
                while True:
                    time.sleep(0.05)
            """), output="quiet")
        helper.join(10)
        assert repr(s.run_cell("rank * 10", ranks="1")) == "10"  # both ranks answer again
    finally:
        s.stop()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_killed_forked_worker_is_reported_with_its_signal(engine, tmp_path):
    s = start_session(engine)
    marker = tmp_path / "running"
    try:
        victim = _worker_pids(s)[1]

        def kill_rank_1() -> None:
            poll_until(marker.exists, 60)
            os.kill(victim, signal.SIGKILL)

        helper = threading.Thread(target=kill_rank_1, daemon=True)
        helper.start()
        with pytest.raises(DistributedError) as info:
            s.run_cell(textwrap.dedent(f"""
                import pathlib, time
                if rank == 0:
                    pathlib.Path({str(marker)!r}).touch()
                time.sleep(120 if rank == 1 else 10)  # rank 1 is killed long before its end
            """), output="quiet", timeout=200)
        helper.join(10)
        assert 1 in [f.rank for f in info.value.failures]
        worker = s.plans[1].worker_id
        assert s.backend.exit_cause(worker, victim) == "SIGKILL"
    finally:
        s.stop()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_template_that_is_not_safe_to_fork_hands_over_to_fresh_workers(
        engine, tmp_path, monkeypatch, capfd):
    # The template imports a module that starts a thread: every fork is refused.
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True)"
        ".start()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setattr("nbdist.backends.ipyparallel.template.IPP_MODULES",
                        (*IPP_MODULES, "starts_a_thread"))
    monkeypatch.setattr("nbdist.backends.dask.forkserver.DASK_PRELOAD",
                        [*DASK_PRELOAD, "starts_a_thread"])
    s = start_session(engine)
    try:
        err = capfd.readouterr().err
        assert "starts as a fresh process, not from the worker template" in err
        if engine == "ipyparallel":
            assert "2 threads run in it" in err
            assert all(TEMPLATE_CMD[engine] not in _parent_cmd(p) for p in _worker_pids(s))
        else:  # forked, then replaced at once by a fresh interpreter
            assert "is not safe to fork: 2 threads run in it" in err
            assert all("--nbdist-fresh-worker" in psutil.Process(p).cmdline()
                       for p in _worker_pids(s))
        check_ddp_matches_union_batch(s)
    finally:
        s.stop()


@pytest.mark.parametrize("engine", ENGINES)
def test_without_a_template_workers_start_fresh(engine):
    s = start_session(engine, template=False)
    try:
        me = os.getpid()
        assert all(psutil.Process(p).ppid() == me for p in _worker_pids(s))
        assert repr(s.run_cell("world_size", ranks="0")) == "2"
    finally:
        s.stop()
