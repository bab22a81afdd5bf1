"""The benchmarks run as their documents write them: every command ``benchmarks/README.md``
and ``benchmarks/RESULTS.md`` show parses and imports what it needs (``--check``), and every
benchmark runs its quick mode (``python -m benchmarks --quick --only NAME``, the smoke run
``python -m benchmarks --quick`` makes) to its end, clusters, torchrun and all: a benchmark
that no longer runs is found by the suite, not by the next person who measures.

The quick modes' counts are too small for their figures to mean anything; only that each
benchmark gets to its summary is checked.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "RESULTS.md"]
# a command as the documents write it: in a code block's line or between backticks
COMMAND = re.compile(r"(?:^|`)((?:bash )?benchmarks/run_all\.sh[^`\n#]*|"
                     r"python (?:-m benchmarks|benchmarks/\w+\.py)[^`\n#]*)", re.MULTILINE)


def documented_commands() -> list[str]:
    found = []
    for doc in DOCS:
        for m in COMMAND.finditer(doc.read_text(encoding="utf-8")):
            cmd = m.group(1).strip()
            if cmd not in found:
                found.append(cmd)
    return found


def _run(cmd: str, *extra: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a documented command as written; past ``timeout`` seconds, kill it and every
    process it started (a benchmark's clusters and torchrun jobs, which a plain kill of the
    command would leave running), then raise ``subprocess.TimeoutExpired``."""
    argv = shlex.split(cmd)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "bash":
        argv = argv[1:]
    if argv[0].endswith("run_all.sh"):  # the script is `python -m benchmarks "$@"`
        argv = [sys.executable, "-m", "benchmarks", *argv[1:]]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([*argv, *extra], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = psutil.Process(proc.pid).children(recursive=True)
        for p in [psutil.Process(proc.pid), *tree]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(tree, timeout=10)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_the_documents_show_a_command_for_every_benchmark():
    commands = documented_commands()
    shown = {m for c in commands for m in re.findall(r"bench_\w+\.py", c)}
    scripts = {p.name for p in (ROOT / "benchmarks").glob("bench_*.py")}
    assert shown == scripts, f"no documented command for {sorted(scripts - shown)}"
    assert any("run_all.sh" in c for c in commands)
    assert any(c.startswith("python -m benchmarks") for c in commands)


@pytest.mark.parametrize("cmd", documented_commands())
def test_a_documented_command_runs_as_written(cmd):
    if "--help" in shlex.split(cmd):
        proc = _run(cmd)
        assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stderr[-3000:]
        return
    proc = _run(cmd, "--check")
    assert proc.returncode == 0, f"`{cmd}` does not run as written:\n{proc.stderr[-3000:]}"
    assert "command line ok" in proc.stdout


def test_check_refuses_a_command_line_that_would_not_run():
    proc = _run("python benchmarks/bench_tune.py --no-such-option", "--check")
    assert proc.returncode == 2 and "unrecognized arguments: --no-such-option" in proc.stderr


def _benchmarks() -> list[str]:
    """The names ``python -m benchmarks --only`` takes, from its own table."""
    spec = importlib.util.spec_from_file_location("_benchmarks_main",
                                                  ROOT / "benchmarks" / "__main__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [b[0] for b in module.BENCHMARKS]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", _benchmarks())
def test_each_benchmark_runs_its_quick_mode_to_the_end(name):
    proc = _run(f"python -m benchmarks --quick --only {name}", timeout=540)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"{name}'s quick mode failed:\n{tail}"
    assert f"{name}: took" in proc.stdout and "FAILED" not in proc.stdout, tail


def test_the_simulated_scale_benchmark_runs_its_quick_mode_to_the_end():
    proc = _run("python benchmarks/bench_scale.py --worlds 64 --seconds 1 --warmup 0.5 "
                "--repeats 1", timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "widget view, 64 ranks:" in proc.stdout and "text view, 64 ranks:" in proc.stdout
    assert "RESULT {" in proc.stdout
