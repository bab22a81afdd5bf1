"""A command run to its end in a process session of its own (a timeout stops every process it
started: torchrun's ranks, a compiler's children), and the same script under a real
``torchrun --standalone --nproc_per_node=2``: the ground truth the library tests compare with."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

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
