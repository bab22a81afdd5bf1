"""``%nbdist run`` fails like torchrun: torchrun's variables, a per-run id, a per-rank error
file whose recorded root cause is shown, and no process of the script outliving a timeout."""

from __future__ import annotations

import json
import time

import psutil
import pytest

from nbdist.errors import CellTimeoutError, DistributedError

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
