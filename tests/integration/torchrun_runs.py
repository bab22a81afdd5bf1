"""A command run to its end in a process session of its own (a timeout stops every process it
started: torchrun's ranks, a compiler's children), and the same script under a real
``torchrun --standalone --nproc_per_node=2``: the ground truth the library tests compare with;
and a launched job (torchrun's, mpirun's) waited for, or killed with all it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest


def run_to_end(cmd: list, cwd: Path, timeout: float, what: str) -> None:
    """Run ``cmd``; fail the test with its stderr's end unless it exits 0 within ``timeout``
    seconds (after which its whole process session is killed)."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{what} did not finish within {timeout:.0f} s")
    assert proc.returncode == 0, err[-3000:]


def under_torchrun(script: Path, out: Path, timeout: float = 300) -> None:
    """``script out`` under torchrun, 2 ranks on this host, in the script's folder."""
    run_to_end([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", str(script), str(out)], script.parent, timeout, "torchrun")


def kill_session(proc: subprocess.Popen) -> None:
    """Kill a job started in a process session of its own, and every process it started
    wherever it put them (a launcher's ranks may lead sessions of their own)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    for child in family:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    """``proc``'s exit status and output once it ends; past ``timeout`` seconds it is killed
    with all it started (nothing a job started may outlive its test)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_session(proc)
    return proc.returncode, out
