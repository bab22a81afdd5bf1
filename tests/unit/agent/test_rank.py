"""How a rank started with the start-up hook reports its end: the frames it leaves in its
node's spool when its script returns, calls ``sys.exit``, or raises. Real processes: a
Python started with ``NBDIST_ATTACH`` and a rank's variables, the hook as installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nbdist.agent import wire
from nbdist.agent.spool import SpoolReader

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def site_dir(tmp_path):
    """A site directory holding the hook as installed, and a sitecustomize that adds it (an
    editable install has no ``.pth`` of its own)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "nbdist-attach.pth").write_bytes((REPO / "nbdist-attach.pth").read_bytes())
    (site / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site)!r})\n")
    return site


def _rank_exit(tmp_path, site_dir, script):
    """Run ``script`` as rank 1 of a job reporting through ``tmp_path/spool``: its exit
    status, and the exit frame it wrote."""
    spool = tmp_path / "spool"
    spool.mkdir()
    (tmp_path / "train.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBDIST_ATTACH")}
    env.update(PYTHONPATH=f"{site_dir}{os.pathsep}{REPO}", RANK="1", WORLD_SIZE="2",
               TORCHELASTIC_RUN_ID="t", NBDIST_ATTACH="tcp://127.0.0.1:9/t",
               NBDIST_ATTACH_SPOOL=str(spool))
    done = subprocess.run([sys.executable, str(tmp_path / "train.py")], env=env,
                          capture_output=True, text=True, timeout=120)
    frames = [wire.decode(f[4:]) for _, f in SpoolReader(str(spool)).read()]
    assert [m["type"] for m in frames][0] == "rank", done.stderr
    (end,) = [m for m in frames if m["type"] == "exit"]
    return done.returncode, end


@pytest.mark.parametrize("call, status", [("sys.exit(3)", 3), ("sys.exit('no data')", 1),
                                          ("raise SystemExit(3)", 3)])
def test_a_script_that_exits_nonzero_reports_its_status_as_a_failure(tmp_path, site_dir,
                                                                     call, status):
    """``sys.exit`` is seen as it is called; a ``SystemExit`` the script raises itself only
    in the status the process exits with, read once it has ended."""
    code, end = _rank_exit(tmp_path, site_dir, f"import sys\n{call}\n")
    assert code == status
    assert end["ok"] is False and end["rank"] == 1 and end["lost"] is False
    assert end["error"] == ("exited with status 3" if status == 3 else "exited: no data")
    assert end["failed_at"] is not None


def test_a_script_that_raises_reports_the_error(tmp_path, site_dir):
    code, end = _rank_exit(tmp_path, site_dir, "raise KeyError('shard 7')\n")
    assert code == 1 and end["ok"] is False and end["error"] == "KeyError: 'shard 7'"


def test_a_script_that_returns_reports_success_and_leaves_nothing_aside(tmp_path, site_dir):
    code, end = _rank_exit(tmp_path, site_dir, "x = 1\n")
    assert code == 0 and end["ok"] is True and end["error"] is None
    assert sorted(p.suffix for p in (tmp_path / "spool").iterdir()) == [".0"]


def test_a_stack_leaves_out_runpy_and_the_agent_before_the_script():
    """``torchrun -m nbdist.agent train.py``: runpy runs the agent, which runs the script with
    runpy again; what is left starts at the script's first frame."""
    import traceback

    from nbdist.agent.rank import script_frames

    agent = os.path.join("site-packages", "nbdist", "agent", "__main__.py")
    frames = [traceback.FrameSummary(f, n, name, line=src) for f, n, name, src in [
        ("<frozen runpy>", 198, "_run_module_as_main", ""),
        ("<frozen runpy>", 88, "_run_code", ""),
        (agent, 61, "<module>", "main()"),
        ("/usr/lib/python3.10/runpy.py", 289, "run_path", ""),
        ("<frozen runpy>", 98, "_run_module_code", ""),
        ("<frozen runpy>", 88, "_run_code", ""),
        ("train.py", 22, "<module>", "main()"),
        ("train.py", 15, "main", "dist.barrier()"),
        ("/opt/tool/runpy.py", 3, "later", "the script's own: kept"),
    ]]
    kept = script_frames(frames)
    assert [(f.filename, f.lineno) for f in kept] == [
        ("train.py", 22), ("train.py", 15), ("/opt/tool/runpy.py", 3)]
    assert "".join(traceback.format_list(kept)).startswith('  File "train.py", line 22')
