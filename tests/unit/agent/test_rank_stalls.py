"""The hang doctor's look at a rank of a job started outside the notebook: the rank's agent
points the worker's sampler at the script's main thread and its file, so a stack report places
the rank at a line of the script (the frames marked the script's own). A real process started
as ``python -m nbdist.agent train.py``, whose code is named by the path as given (as
:func:`runpy.run_path` names it); under the start-up hook the script's file is the absolute
path Python names it by (tests/integration/watch/test_stalls.py: ``train.py:27``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from nbdist.agent import wire
from nbdist.agent.rank import script_path
from nbdist.agent.spool import SpoolReader
from nbdist.telemetry.columns import unpack

REPO = Path(__file__).resolve().parents[3]

# The sampler runs on the event sink's thread once the script makes no progress for a while;
# here another thread asks it at once, while the main thread waits at line 10.
SCRIPT = textwrap.dedent("""
    import threading
    from nbdist.runtime.measure.stall_probe import watch
    ready, sampled = threading.Event(), threading.Event()
    def look():
        ready.wait(10)
        watch._sample("stall", None, 0.0, force=True)
        sampled.set()
    threading.Thread(target=look).start()
    ready.set(); sampled.wait(10)
""").lstrip()
LINE = 9


def test_a_ranks_stack_report_stands_at_the_scripts_line(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    (tmp_path / "train.py").write_text(SCRIPT)
    assert SCRIPT.splitlines()[LINE - 1].startswith("ready.set()")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBDIST_ATTACH")}
    env.update(PYTHONPATH=str(REPO), RANK="0", WORLD_SIZE="1",
               TORCHELASTIC_RUN_ID="t", NBDIST_ATTACH="tcp://127.0.0.1:9/t",
               NBDIST_ATTACH_SPOOL=str(spool))
    done = subprocess.run([sys.executable, "-m", "nbdist.agent", "train.py"], env=env,
                          cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    frames = [wire.decode(f[4:]) for _, f in SpoolReader(str(spool)).read()]
    events = [e for m in frames if m["type"] == "batch" for e in unpack(m["batch"]["events"])]
    (stack,) = [e for e in events if e["kind"] == "stack"]
    mine = [f for f in stack["frames"] if f["cell"]]
    assert [(f["line"], f["name"]) for f in mine] == [(LINE, "<module>")], stack["frames"]
    assert mine[0]["file"] == "train.py" and mine[0]["call"] == "sampled.wait(10)"
    # the innermost frame: threading's wait, under the script's line
    assert stack["frames"][-1]["name"] == "threading.Condition.wait"


def test_the_script_is_the_file_a_python_rank_runs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    assert script_path([str(script), "--lr", "0.1"]) == str(script)
    assert script_path(["-c", "pass"]) == script_path(["-m"]) == script_path([]) == ""
    assert script_path([str(tmp_path / "missing.py")]) == ""
