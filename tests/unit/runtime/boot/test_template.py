"""The worker template's own logic, with real processes but without torch: the check before a
fork, the fork server's replies (pid, exit status, refusals) and the notebook's fallback.

Templates here import only the standard library (the module list is given), so each starts
in a fraction of a second; the engines' use of them is in tests/integration/boot/test_template.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from nbdist.boot import template
from nbdist.runtime.boot import template as worker_half

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not template.supported(), reason="worker templates need Linux")]

HAZARDS = textwrap.dedent("""
    import json, socket, sys, threading, time
    from nbdist.runtime.boot.template import fork_hazards, thread_count
    out = {"alone": fork_hazards()}
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    out["thread"] = fork_hazards()
    stop.set(); t.join()
    # join() returns as the thread finishes in Python; the kernel lists its task a moment more
    deadline = time.monotonic() + 10
    while thread_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    s = socket.socket()
    out["socket"] = fork_hazards()
    out["socket allowed"] = fork_hazards(frozenset([s.fileno()]))
    json.dump(out, sys.stdout)
""")


def test_fork_hazards_names_threads_and_sockets_and_nothing_else():
    # In a fresh interpreter: pytest's own process runs threads of its own (its timeouts).
    out = subprocess.run([sys.executable, "-c", HAZARDS], capture_output=True, text=True,
                         check=True, timeout=30)
    import json

    found = json.loads(out.stdout)
    assert found["alone"] == []
    assert found["thread"] == ["2 threads run in it"]
    assert len(found["socket"]) == 1 and found["socket"][0].startswith("it holds 1 socket")
    assert found["socket allowed"] == []


def test_only_import_time_variables_that_differ_count():
    ours = {"PYTHONPATH": "/a", "TORCH_LOGS": "+dynamo", "HOME": "/root",
            "PYTHONUNBUFFERED": "1"}
    assert worker_half.env_mismatch(dict(ours, HOME="/other", NCCL_DEBUG="INFO"), ours) == []
    assert worker_half.env_mismatch(dict(ours, PYTHONPATH="/b"), ours) == ["PYTHONPATH"]
    theirs = {k: v for k, v in ours.items() if k != "TORCH_LOGS"}
    assert worker_half.env_mismatch(theirs, ours) == ["TORCH_LOGS"]
    # applied by the child itself after the fork
    assert worker_half.env_mismatch(dict(ours, PYTHONUNBUFFERED="0"), ours) == []
    # set by the template's own imports: counts only where the request says otherwise
    after = dict(ours, TORCHINDUCTOR_CACHE_DIR="/tmp/x")
    assert worker_half.env_mismatch(ours, ours, after) == []
    assert worker_half.env_mismatch(after, ours, after) == []
    assert worker_half.env_mismatch(dict(ours, TORCHINDUCTOR_CACHE_DIR="/y"), ours,
                                    after) == ["TORCHINDUCTOR_CACHE_DIR"]


@pytest.fixture
def modules_dir(tmp_path, monkeypatch):
    """A directory on the templates' and their children's PYTHONPATH, for test modules."""
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    monkeypatch.setenv("PYTHONPATH", path)
    (tmp_path / "child_says.py").write_text(textwrap.dedent("""
        import os, sys
        print(" ".join(sys.argv[1:]), os.environ.get("GREETING"), os.getcwd(), flush=True)
        line = sys.stdin.readline()
        print("read", line.strip(), file=sys.stderr, flush=True)
        sys.exit(int(os.environ.get("EXIT", "0")))
    """))
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True)"
        ".start()\n")
    (tmp_path / "sleeps.py").write_text("import time\ntime.sleep(60)\n")
    return tmp_path


@pytest.fixture
def make_template():
    made: list[template.Template] = []

    def make(*modules: str) -> template.Template:
        t = template.Template(modules or ("json",))
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()
        assert not t.alive


def test_a_forked_child_runs_the_module_with_the_requests_stdio_env_and_cwd(
        modules_dir, make_template, tmp_path):
    t = make_template()
    env = dict(os.environ, GREETING="hello", EXIT="3")
    child = t.popen([sys.executable, "-m", "child_says", "a", "b"], env=env, cwd=str(tmp_path))
    assert child.pid != t.pid
    assert child.stdout.readline().split() == ["a", "b", "hello", str(tmp_path)]
    child.stdin.write("ping\n")
    assert child.stderr.readline().strip() == "read ping"
    assert child.wait(30) == 3  # the exit status, as the template saw it
    assert child.poll() == 3


def test_a_killed_child_reports_the_signal(modules_dir, make_template):
    t = make_template()
    child = t.popen([sys.executable, "-m", "sleeps"])
    assert child.poll() is None
    child.kill()
    assert child.wait(30) == -signal.SIGKILL


def test_a_template_running_a_thread_refuses_and_the_caller_starts_fresh(
        modules_dir, make_template, monkeypatch, capsys):
    t = make_template("json", "starts_a_thread")
    with pytest.raises(template.Refused, match="2 threads run in it"):
        t.fork([sys.executable, "-m", "child_says"])
    monkeypatch.setattr(template, "_active", t)
    proc = template.popen_or_fresh([sys.executable, "-m", "child_says", "fresh"], "the test",
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate("x\n", timeout=30)
    assert isinstance(proc, subprocess.Popen)  # a fresh process, not a fork
    assert out.split()[0] == "fresh"
    line = capsys.readouterr().err
    assert "nbdist: the test starts as a fresh process, not from the worker template" in line
    assert "2 threads run in it" in line


def test_a_changed_import_time_environment_is_refused(modules_dir, make_template):
    t = make_template()
    with pytest.raises(template.Refused, match="TORCH_LOGS"):
        t.fork([sys.executable, "-m", "child_says"], env=dict(os.environ, TORCH_LOGS="+all"))


def test_only_python_dash_m_of_the_same_interpreter(make_template):
    t = make_template()
    with pytest.raises(template.Refused, match="python -m MODULE"):
        t.fork(["/bin/sh", "-c", "true"])
    with pytest.raises(template.Refused, match="it runs"):
        t.fork(["/usr/bin/env", "-m", "json.tool"])


def test_the_template_exits_when_its_stdin_closes_and_children_outlive_it(
        modules_dir, make_template):
    t = make_template()
    child = t.popen([sys.executable, "-m", "sleeps"])
    t.close()  # closes its stdin: it exits at once
    assert not t.alive
    assert child.poll() is None  # the child ends on its own terms (here: killed by the test)
    child.kill()
    assert child.wait(30) == -1  # the template is gone: the status is unknown, the exit known
