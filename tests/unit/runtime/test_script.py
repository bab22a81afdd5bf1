"""A ``%nbdist run`` script's end on one rank (:mod:`nbdist.runtime.script`): its exit status,
sent as the rank's end event, is what the run's record says of the rank (finished, failed with
that status, killed by a named signal), as the result the notebook raises from says it."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from nbdist.runtime.capture import EventSink
from nbdist.runtime.script import exit_words, run
from nbdist.telemetry.aggregate import RunState
from nbdist.telemetry.columns import unpack
from nbdist.telemetry.events import STREAM
from nbdist.telemetry.states import RankState

pytestmark = pytest.mark.timeout(60)


def _run(tmp_path, code: str):
    """Run ``code`` as a script on rank 0; its result and the rank's row in the run's record."""
    script = tmp_path / "script.py"
    script.write_text(code)
    sent: list[dict] = []
    sink = EventSink(0, sent.append, interval=3600)
    try:
        result = run(str(script), code, [], {}, str(tmp_path), sink)
    finally:
        sink.close()
    state = RunState([0])
    state.feed(sent)
    state.finish()  # what the notebook does once the call returned
    row = state.snapshot().ranks[0]
    return result, (row.state, row.error)


def test_exit_status_zero_is_a_finished_rank(tmp_path):
    result, row = _run(tmp_path, "print('trained')\n")
    assert result["ok"] and result["returncode"] == 0 and result.get("error") is None
    assert row == (RankState.DONE, None)


def test_a_non_zero_status_is_a_failure_with_that_status(tmp_path):
    result, row = _run(tmp_path, "import sys\nsys.exit(3)\n")
    assert not result["ok"] and result["returncode"] == 3
    assert (result["error"]["ename"], result["error"]["evalue"]) == ("ScriptError",
                                                                     "exited with status 3")
    assert row == (RankState.FAILED, "ScriptError: exited with status 3")


def test_a_signal_is_named_with_torchruns_exit_code(tmp_path):
    result, row = _run(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert result["returncode"] == -signal.SIGKILL  # what torchrun reports as exitcode
    assert result["error"]["evalue"] == "killed by SIGKILL (exit code -9)"
    assert row == (RankState.FAILED, "ScriptError: killed by SIGKILL (exit code -9)")


def test_an_uncaught_exception_is_pythons_exit_status_one(tmp_path):
    result, row = _run(tmp_path, "raise SystemError('boom')\n")
    assert result["returncode"] == 1
    assert row == (RankState.FAILED, "ScriptError: exited with status 1")


@pytest.mark.parametrize("code, words", [
    (0, "exited with status 0"), (3, "exited with status 3"),
    (-signal.SIGTERM, "killed by SIGTERM (exit code -15)"),
    (-signal.SIGABRT, "killed by SIGABRT (exit code -6)"),
    (-200, "killed by signal 200 (exit code -200)"),
])
def test_exit_words(code, words):
    assert exit_words(code) == words


def test_the_script_runs_in_this_interpreter(tmp_path):
    code = f"import sys\nsys.exit(0 if sys.executable == {sys.executable!r} else 5)\n"
    result, _ = _run(tmp_path, code)
    assert result["returncode"] == 0


def test_a_failing_scripts_traceback_is_pythons_own(tmp_path):
    # The script's process runs it through nbdist's agent; what it prints of its failure is
    # what `python script.py` prints, the agent's and runpy's frames left out.
    code = "def f():\n    raise ValueError('bad shard')\n\nf()\n"
    script = tmp_path / "script.py"
    script.write_text(code)
    direct = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=30)
    sent: list[dict] = []
    sink = EventSink(0, sent.append, interval=3600)
    try:
        result = run(str(script), code, [], {}, str(tmp_path), sink)
    finally:
        sink.close()
    stderr = "".join(e["text"] for b in sent for e in unpack(b["events"])
                     if e["kind"] == STREAM and e["name"] == "stderr")
    assert result["returncode"] == direct.returncode == 1
    assert stderr == direct.stderr
