"""``%nbdist run`` fails like torchrun: torchrun's variables, a per-run id, a per-rank error
file whose recorded root cause is shown, no process of the script outliving a timeout, and each
rank's end read from its exit status (finished, failed with that status, killed by a named
signal), also for a script that runs long enough for the dashboard to show it; and its ranks
report to the run's record as a cell's do (DDP steps, progress bars, logged values)."""

from __future__ import annotations

import json
import time

import psutil
import pytest

from nbdist.errors import CellTimeoutError, DistributedError
from nbdist.telemetry.snapshot import RunSnapshot
from nbdist.telemetry.states import RankState

pytestmark = pytest.mark.timeout(240)

ENV_SCRIPT = """
import json, os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
        "ROLE_NAME", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING"]
values = {k: os.environ[k] for k in keys}   # a KeyError here is the bug this guards against
with open(os.path.join(sys.argv[1], f"env{values['RANK']}.json"), "w") as f:
    json.dump(values, f)
"""

RECORD_SCRIPT = """
import os, time
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    if os.environ["RANK"] == "1":
        raise ValueError("bad shard on rank one")
    time.sleep(1.5)  # rank 0 fails later: rank 1's is the root cause
    raise RuntimeError("rank zero follows")

if __name__ == "__main__":
    main()
"""

TREE_SCRIPT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.path.join(sys.argv[1], f"pids{os.environ['RANK']}"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
time.sleep(600)
"""

# Waits (past the dashboard's quiet threshold: the run then has news to draw) until the test
# says the notebook's record shows the run, then ends with the exit status of argv[2] on rank 1.
SHOWN_SCRIPT = """
import os, sys, time
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
print("rank", os.environ["RANK"], "saw the dashboard:", os.path.exists(sys.argv[1]))
sys.exit(int(sys.argv[2]) if os.environ["RANK"] == "1" else 0)
"""

DDP_STEPS = 8

# A plain DDP script, no nbdist line but its progress bar: what a cell's ranks report, it
# reports (steps, the bar, a logged value).
DDP_SCRIPT = f"""
import torch, torch.distributed as dist
import nbdist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in nbdist.progress(range({DDP_STEPS}), desc="train"):
    loss = model(torch.ones(32, 16)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    nbdist.log(loss=loss.item())
dist.destroy_process_group()
"""

KILLED_SCRIPT = """
import os, signal
if os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
"""


class Recorded:
    """Wraps the session's view factory: touches ``shown`` once a snapshot of the running
    script has news for the dashboard (it appears on screen then), and keeps the snapshot
    the run's view is closed with (what the dashboard draws last)."""

    def __init__(self, make_view, shown):
        self.make_view, self.shown = make_view, shown
        self.news = False
        self.final: list[RunSnapshot] = []

    def __call__(self, *args, **kw):
        inner, outer = self.make_view(*args, **kw), self

        class View:
            def output(self, batches):
                inner.output(batches)

            def refresh(self, snapshot, force=False):
                inner.refresh(snapshot, force)
                if not outer.news and snapshot().has_news:
                    outer.news = True
                    outer.shown.touch()

            def close(self, snap):
                outer.final.append(snap)
                inner.close(snap)

        return View()


def _run_shown(cluster, monkeypatch, tmp_path, status) -> Recorded:
    """Run SHOWN_SCRIPT ending with ``status`` on rank 1; the recorder of its view."""
    script = tmp_path / "shown.py"
    script.write_text(SHOWN_SCRIPT)
    rec = Recorded(cluster.cells._make_view, tmp_path / "shown")
    monkeypatch.setattr(cluster.cells, "_make_view", rec)
    try:
        cluster.run_script(str(script), [str(rec.shown), str(status)], output="quiet",
                           timeout=90)
    finally:
        assert rec.news, "the run never had news for the dashboard"
    return rec


def test_a_script_shown_on_the_dashboard_ends_finished_on_every_rank(cluster, monkeypatch,
                                                                     tmp_path):
    snap = _run_shown(cluster, monkeypatch, tmp_path, 0).final[-1]
    assert [(r.rank, r.state, r.error) for r in snap.ranks] == [
        (0, RankState.DONE, None), (1, RankState.DONE, None)]
    assert snap.finished and not snap.failed


def test_a_scripts_exit_status_is_its_ranks_end(cluster, monkeypatch, tmp_path):
    with pytest.raises(DistributedError) as info:
        _run_shown(cluster, monkeypatch, tmp_path, 3)
    snap = cluster.cells._make_view.final[-1]  # the recorder _run_shown installed
    assert [(r.rank, r.state, r.error) for r in snap.ranks] == [
        (0, RankState.DONE, None),
        (1, RankState.FAILED, "ScriptError: exited with status 3")]
    err = info.value
    assert [(f.rank, f.ename, f.evalue) for f in err.failures] == [
        (1, "ScriptError", "exited with status 3")]
    assert "rank 1" in str(err) and "exited with status 3" in str(err)


def test_a_rank_killed_by_a_signal_is_named(cluster, monkeypatch, tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SCRIPT)
    rec = Recorded(cluster.cells._make_view, tmp_path / "shown")
    monkeypatch.setattr(cluster.cells, "_make_view", rec)
    with pytest.raises(DistributedError) as info:
        cluster.run_script(str(script), output="quiet", timeout=60)
    # torchrun reports this rank's exit code as -9, the signal's number negated
    words = "killed by SIGKILL (exit code -9)"
    assert [(f.rank, f.evalue) for f in info.value.failures] == [(1, words)]
    assert [(r.rank, r.state, r.error) for r in rec.final[-1].ranks] == [
        (0, RankState.DONE, None), (1, RankState.FAILED, f"ScriptError: {words}")]


def test_script_sees_every_variable_torchrun_sets_and_a_fresh_run_id(cluster, tmp_path):
    script = tmp_path / "env.py"
    script.write_text(ENV_SCRIPT)
    ids = []
    for _ in range(2):
        cluster.run_script(str(script), [str(tmp_path)], output="quiet")
        env = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in (0, 1)]
        assert [e["RANK"] for e in env] == ["0", "1"]
        assert env[0]["TORCHELASTIC_RUN_ID"] == env[1]["TORCHELASTIC_RUN_ID"] != "nbdist"
        assert env[0]["TORCHELASTIC_ERROR_FILE"] != env[1]["TORCHELASTIC_ERROR_FILE"]
        assert env[0]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        ids.append(env[0]["TORCHELASTIC_RUN_ID"])
    assert ids[0] != ids[1]  # each launch is a new run, as with torchrun --standalone


def test_recorded_root_cause_is_shown(cluster, tmp_path):
    script = tmp_path / "record.py"
    script.write_text(RECORD_SCRIPT)
    with pytest.raises(DistributedError) as info:
        cluster.run_script(str(script), output="quiet")
    err = info.value
    first = err.causes[0]
    assert first.rank == 1 and first.ename == "ValueError"
    assert first.evalue == "bad shard on rank one" and first.timestamp
    assert "raise ValueError" in first.traceback
    assert str(err).startswith("script record.py failed on ranks 0-1: first on rank 1: "
                               "ValueError: bad shard on rank one")
    assert {f.rank for f in err.failures} == {0, 1}


def test_timeout_stops_the_scripts_whole_process_tree(cluster, tmp_path):
    script = tmp_path / "tree.py"
    script.write_text(TREE_SCRIPT)
    with pytest.raises(CellTimeoutError):
        cluster.run_script(str(script), [str(tmp_path)], timeout=4, output="quiet")
    pids = [int(p) for r in (0, 1) for p in (tmp_path / f"pids{r}").read_text().split()]
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)  # processes exit asynchronously; nothing to wait on across processes
    assert not alive, f"script processes still running: {alive}"


def test_a_ddp_scripts_ranks_report_steps_bars_and_values(cluster, tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    cluster.run_script(str(script), output="quiet", timeout=120)
    run = cluster.last_run
    assert run is not None and run.steps == DDP_STEPS  # DDP steps, measured as in a cell
    assert [(r.rank, r.state) for r in run.ranks] == [(0, RankState.DONE), (1, RankState.DONE)]
    assert all(r.samples_per_s and r.samples_per_s > 0 for r in run.ranks)
    bars = [(r.rank, r.bar.n, r.bar.total, r.bar.done) for r in run.ranks]
    assert bars == [(0, DDP_STEPS, DDP_STEPS, True), (1, DDP_STEPS, DDP_STEPS, True)]
    assert {r: len(v) for r, v in run.scalar_series["loss"].items()} == {0: DDP_STEPS,
                                                                        1: DDP_STEPS}
