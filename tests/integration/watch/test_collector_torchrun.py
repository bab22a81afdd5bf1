"""A real ``torchrun --standalone --nproc_per_node=2`` job, started with the line
``%nbdist attach`` prints, reports to a collector in this process: both ranks, their steps
while it runs, and its end. Without the variable the job imports nothing of nbdist; with a
notebook that is not there it runs as without one.

The start-up hook is the ``nbdist-attach.pth`` a wheel installs; this checkout is installed
in editable mode, so the tests put that same file in a site directory of their own
(``site.addsitedir`` from a ``sitecustomize``, as site-packages is processed at start-up)."""

from __future__ import annotations

import ast
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from torchrun_runs import finish, kill_session

from nbdist.agent.hook import node_directory
from nbdist.watch.collector import Collector
from nbdist.watch.watched import WatchedJob

pytestmark = pytest.mark.timeout(400)

REPO = Path(__file__).resolve().parents[3]
STEPS = 24  # optimizer steps per rank
HELD_AT = 8  # the script waits at this step for the test to see it live

TRAIN = textwrap.dedent(f"""
    import datetime, os, sys, time
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    go = sys.argv[1]
    rank = int(os.environ["RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(0)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    model = DDP(torch.nn.Linear(16, 4))
    sys.stdout.write(f"GROUP rank {{rank}} of {{dist.get_world_size()}}, restart {{restart}}\\n")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fail_at = int(os.environ.get("FAIL_AT", "-1"))
    for i in range({STEPS}):
        if i == fail_at and rank == 1:
            raise ValueError(f"bad batch at step {{i}}")
        if i == int(os.environ.get("EXIT_AT", "-1")) and rank == 1:
            sys.exit(3)
        if i == int(os.environ.get("RAISE_EXIT_AT", "-1")) and rank == 1:
            raise SystemExit(3)  # seen by no hook: only the status the process exits with
        if i == int(os.environ.get("DIE_AT", "-1")) and rank == 1 and not restart:
            deadline = time.time() + 120  # until the test saw the steps before it
            while not os.path.exists(go + ".die") and time.time() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), 9)  # SIGKILL: no word of how it ended
        if i == {HELD_AT} and rank == 1:  # rank 0 waits in the all-reduce
            deadline = time.time() + 120
            while not os.path.exists(go) and time.time() < deadline:
                time.sleep(0.05)
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.01)
    if rank == 0 and os.environ.get("WEIGHTS"):
        torch.save(model.module.state_dict(), os.environ["WEIGHTS"])
    dist.destroy_process_group()
    mods = sorted(m for m in sys.modules if m.startswith("nbdist"))
    sys.stdout.write(f"NBDIST_MODULES {{mods}}\\n")  # one write: the ranks share the pipe
    sys.stdout.flush()
""")

#: the script's line where rank 0 waits for rank 1
BACKWARD_LINE = next(i for i, line in enumerate(TRAIN.splitlines(), 1)
                     if line.strip() == "loss.backward()")


def _env(site, attach=None, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBDIST_ATTACH")}
    env.update(extra)
    env["PYTHONPATH"] = f"{site}{os.pathsep}{REPO}"
    if attach is not None:
        env["NBDIST_ATTACH"] = attach
    return env


def _torchrun(tmp_path, env, go, agent=False, restarts=0):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         f"--max-restarts={restarts}", *(["-m", "nbdist.agent"] if agent else []),
         str(script), str(go)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)


def _until(cond, timeout, proc):
    end = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, "the job ended first:\n" + proc.stdout.read()
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.05)


def test_a_torchrun_job_reports_both_ranks_live_and_ends_finished_with_every_step(
        tmp_path, site_dir):
    collector = Collector()
    go = tmp_path / "go"
    proc = _torchrun(tmp_path, _env(site_dir, collector.address.line), go)
    try:
        def live():
            recs = collector.jobs.records()
            return recs and len(recs[0].steps) == 2 and min(recs[0].steps.values()) >= 1
        _until(live, 180, proc)
        (rec,) = collector.jobs.records()
        # seen while the job runs, held before step HELD_AT
        assert rec.state == "running" and rec.world_size == 2
        assert all(1 <= n <= HELD_AT for n in rec.steps.values()), rec
        assert rec.key.startswith("torchrun-") and rec.hosts == (socket.gethostname(),)
        # where each rank is now: rank 1 sleeps in the script's loop, rank 0 is held in its
        # backward's all-reduce (a C call) waiting for rank 1, once both got to step HELD_AT
        job = WatchedJob(collector.jobs, collector.jobs.get(rec.id), collector.stacks)
        stacks: dict = {}

        def held():
            stacks.update(job.stacks(timeout=5))
            return "loss.backward()" in stacks.get(0, "") and "sleep" in stacks.get(1, "")
        _until(held, 90, proc)
        assert sorted(stacks) == [0, 1], stacks
        assert stacks[1].rstrip().endswith("time.sleep(0.05)"), stacks[1]
        assert 'File "' + str(tmp_path / "train.py") in stacks[1]
        script_frame = (f'File "{tmp_path / "train.py"}", line {BACKWARD_LINE}, in <module>\n'
                        "    loss.backward()")
        assert script_frame in stacks[0], stacks[0]
        assert "run_backward(" in stacks[0].rstrip().splitlines()[-1]  # inside torch's engine
        assert "nbdist" not in stacks[0] + stacks[1]  # the script's frames, not the agent's
        assert list(job.stacks(rank=1)) == [1]
        go.touch()
        code, out = finish(proc)
        assert code == 0, out
        _until_ended = time.monotonic() + 30
        while collector.jobs.records()[0].state == "running":
            assert time.monotonic() < _until_ended, collector.jobs.records()
            time.sleep(0.05)
        (rec,) = collector.jobs.records()
        assert rec.state == "finished", rec
        assert rec.steps == {0: STEPS, 1: STEPS}
        assert rec.dropped == 0 and rec.error is None
        assert collector.accepted == 1  # one connection for the host: torchrun's
        # the ranks measured with the workers' instruments: nbdist was loaded there
        assert out.count("nbdist.agent.rank") == 2
    finally:
        if proc.poll() is None:
            kill_session(proc)
        collector.close()


def _imported(importtime: str) -> list[str]:
    """The modules ``python -X importtime`` says it imported (an editable install's finder,
    ``__editable___nbdist_..._finder``, is the installer's, not nbdist)."""
    return [line.rsplit("|", 1)[1].strip() for line in importtime.splitlines()
            if line.startswith("import time:") and "|" in line][1:]


def test_without_the_variable_nothing_of_nbdist_is_imported(tmp_path, site_dir):
    hooked = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"],
                            env=_env(site_dir, "tcp://127.0.0.1:9/t"), capture_output=True,
                            text=True, timeout=60)
    assert "nbdist.agent.hook" in _imported(hooked.stderr)  # in place, and runs when set
    plain = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"],
                           env=_env(site_dir), capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and "site" in _imported(plain.stderr)
    assert [m for m in _imported(plain.stderr) if m.split(".")[0] == "nbdist"] == []
    go = tmp_path / "go"
    go.touch()
    code, out = finish(_torchrun(tmp_path, _env(site_dir), go))
    assert code == 0, out
    assert out.count("NBDIST_MODULES []") == 2, out


def test_a_notebook_that_is_not_there_costs_the_job_nothing(tmp_path, site_dir):
    gone = Collector()
    line = gone.address.line
    gone.close()  # its port now refuses: the forwarder retries with back-off, ranks spool
    go = tmp_path / "go"
    go.touch()
    code, out = finish(_torchrun(tmp_path, _env(site_dir, line), go))
    assert code == 0, out
    assert out.count("NBDIST_MODULES") == 2 and "Traceback" not in out, out


@pytest.mark.parametrize("how, error", [("FAIL_AT", "ValueError: bad batch at step 3"),
                                        ("EXIT_AT", "exited with status 3"),
                                        ("RAISE_EXIT_AT", "exited with status 3")])
def test_a_rank_that_raises_or_exits_nonzero_fails_the_job_with_its_error(
        tmp_path, site_dir, how, error):
    collector = Collector()
    go = tmp_path / "go"
    go.touch()
    try:
        code, out = finish(_torchrun(tmp_path, _env(site_dir, collector.address.line,
                                                      **{how: "3"}), go))
        assert code != 0
        # torchrun's own account of the failed rank: its exit status
        assert "exitcode  : " + ("1" if how == "FAIL_AT" else "3") in out, out
        end = time.monotonic() + 30
        while not collector.jobs.records() or collector.jobs.records()[0].state == "running":
            assert time.monotonic() < end, collector.jobs.records()
            time.sleep(0.05)
        (rec,) = collector.jobs.records()
        assert rec.state == "failed", rec
        assert rec.error == error
        assert rec.steps[1] == 3  # the steps it took before the error
    finally:
        collector.close()


def test_ranks_started_as_python_m_nbdist_agent_elect_one_forwarder_for_their_node(tmp_path):
    """No start-up hook (the launcher does not report): the first rank to lock the node's
    directory forwards for both, and waits at its exit for the other's end."""
    collector = Collector()
    go = tmp_path / "go"
    go.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBDIST_ATTACH")}
    env.update(PYTHONPATH=str(REPO), NBDIST_ATTACH=collector.address.line)
    try:
        code, out = finish(_torchrun(tmp_path, env, go, agent=True))
        assert code == 0, out
        end = time.monotonic() + 30
        while not collector.jobs.records() or collector.jobs.records()[0].state == "running":
            assert time.monotonic() < end, collector.jobs.records()
            time.sleep(0.05)
        (rec,) = collector.jobs.records()
        assert rec.state == "finished" and rec.steps == {0: STEPS, 1: STEPS}, rec
        assert collector.accepted == 1
        # the forwarding rank removed the node's directory when its ranks had ended
        run_id = rec.key.removeprefix("torchrun-")
        assert not os.path.exists(node_directory(collector.address,
                                                 {"TORCHELASTIC_RUN_ID": run_id}))
    finally:
        collector.close()


def test_a_rank_killed_under_max_restarts_shows_its_death_and_the_restart_in_one_view(
        tmp_path, site_dir):
    collector = Collector()
    go = tmp_path / "go"
    go.touch()
    # torchrun's agent keeps one TCPStore for every attempt, and its workers' keys are not
    # told apart by attempt: the restarted rank 0 may read the address the killed rank 1 had
    # and find it refused (seen here with torch 2.13). Each attempt's rank 0 hosts a store of
    # its own with this, as torch's maintainers advise.
    env = _env(site_dir, collector.address.line, DIE_AT="3",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = _torchrun(tmp_path, env, go, restarts=1)
    try:
        # rank 1 dies at its fourth step once the collector saw its first three: a SIGKILLed
        # rank's last unsent steps are lost, and on a loaded machine the first three may
        # not have left it yet (seen in a CI run: no step of the first attempt)
        _until(lambda: (collector.jobs.records()
                        and collector.jobs.records()[0].steps.get(1, 0) >= 3), 180, proc)
        Path(f"{go}.die").touch()
        code, out = finish(proc)
        assert code == 0, out  # the restarted attempt finished
        # and trained as a group of two, as the first one did
        for rank in (0, 1):
            assert out.count(f"GROUP rank {rank} of 2, restart 1") == 1, out
        end = time.monotonic() + 30
        while not collector.jobs.records() or collector.jobs.records()[0].state == "running":
            assert time.monotonic() < end, collector.jobs.records()
            time.sleep(0.05)
        (rec,) = collector.jobs.records()
        assert (rec.state, rec.restarts, rec.world_size) == ("finished", 1, 2), rec
        assert rec.steps == {0: STEPS, 1: STEPS}  # the attempt that ran to the end
        job = collector.jobs.get(rec.id)
        notes = job.run.notes
        assert any(n.startswith("rank 1 (pid ") and "ended without saying how" in n
                   for n in notes), notes
        assert notes[-1] == "the launcher restarted the ranks (restart 1)", notes
        # one view: the first attempt's rows kept (rank 1 died), the chart marks the death
        # and each rank starting again where the first attempt stopped
        snap = job.snapshot()
        former = {r.rank: r for r in snap.former}
        assert sorted(former) == [0, 1] and former[1].state.value == "died", snap.former
        assert 0 < former[1].steps <= 3  # SIGKILLed at its fourth (2 in one run)
        joined = [m for m in snap.marks if m.kind == "joined"]
        assert sorted(m.text.split(": ", 1)[1] for m in joined) == [
            f"rank {r} started again (restart 1)" for r in (0, 1)]
        assert {m.step for m in joined} == {job.restart_step}
        assert job.restart_step == max(r.steps for r in snap.former) > 0
        assert any(m.kind == "died" and m.rank == 1 for m in snap.marks), snap.marks
        assert collector.accepted == 1  # torchrun's process reported both attempts
    finally:
        if proc.poll() is None:
            kill_session(proc)
        collector.close()


#: the notebook's kernel, in a process of its own: a collector that says where it listens,
#: then each job's steps as they change
KERNEL = textwrap.dedent("""
    import sys, time
    from nbdist.watch.collector import Collector
    c = Collector()
    print(c.address.line, flush=True)
    said = None
    while True:
        steps = [r.steps for r in c.jobs.records()]
        if steps != said:
            print("STEPS", steps, flush=True)
            said = steps
        time.sleep(0.05)
""")


def test_a_kernel_killed_mid_job_leaves_the_job_to_finish_with_the_weights_it_has_alone(
        tmp_path, site_dir):
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL], env=_env(site_dir),
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    go = tmp_path / "go"
    try:
        line = kernel.stdout.readline().strip()
        attached = _torchrun(tmp_path, _env(site_dir, line, WEIGHTS=str(tmp_path / "a.pt")),
                             go)
        try:
            # the kernel sees both ranks step; then it dies, SIGKILLed, while they train
            steps: list = []
            while not (steps and len(steps[0]) == 2 and min(steps[0].values()) >= 1):
                said = kernel.stdout.readline()
                assert said, "the kernel ended"
                if said.startswith("STEPS "):
                    steps = ast.literal_eval(said.removeprefix("STEPS "))
            assert max(steps[0].values()) <= HELD_AT  # mid-job: rank 1 waits for the go
            os.killpg(kernel.pid, signal.SIGKILL)
            kernel.wait(timeout=30)
            go.touch()
            code, out = finish(attached)
        finally:
            if attached.poll() is None:
                kill_session(attached)
        assert code == 0 and out.count("NBDIST_MODULES") == 2, out
        assert "Traceback" not in out, out
        assert out.count("nbdist.agent.rank") == 2  # it was attached to the end
        # the same job, never attached
        code, out = finish(_torchrun(tmp_path, _env(site_dir, WEIGHTS=str(tmp_path / "u.pt")),
                                      go))
        assert code == 0 and out.count("NBDIST_MODULES []") == 2, out
    finally:
        if kernel.poll() is None:
            os.killpg(kernel.pid, signal.SIGKILL)
            kernel.wait()
    import torch

    mine, alone = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "u.pt")
    assert sorted(mine) == sorted(alone) == ["bias", "weight"]
    assert all(torch.equal(mine[k], alone[k]) for k in mine)  # bit for bit


def test_a_killed_torchrun_leaves_its_ranks_reporting_through_one_of_them(tmp_path, site_dir):
    """``kill -9`` of torchrun, its node's forwarder: its ranks run on (torch starts each in
    a session of its own), the first to take the node's lock forwards from then on, and the
    job ends finished with every step and both ends, not lost."""
    import psutil

    collector = Collector()
    go = tmp_path / "go"
    proc = _torchrun(tmp_path, _env(site_dir, collector.address.line), go)
    ranks: list = []
    try:
        def live():
            recs = collector.jobs.records()
            return recs and len(recs[0].steps) == 2 and min(recs[0].steps.values()) >= 1
        _until(live, 180, proc)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "train.py" in " ".join(p.cmdline())]
        assert len(ranks) == 2, ranks
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only: no exit of its runs
        proc.wait(timeout=30)
        go.touch()
        gone, alive = psutil.wait_procs(ranks, timeout=180)
        assert not alive, "the ranks did not finish"
        end = time.monotonic() + 60
        while collector.jobs.records()[0].state == "running":
            assert time.monotonic() < end, collector.jobs.records()
            time.sleep(0.05)
        (rec,) = collector.jobs.records()
        assert rec.state == "finished", (rec, collector.jobs.get(rec.id).notes)
        assert rec.steps == {0: STEPS, 1: STEPS} and rec.error is None
        assert collector.accepted == 2  # torchrun's connection, then a rank's
    finally:
        if proc.poll() is None:
            kill_session(proc)
        for p in ranks:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        collector.close()
