"""No orphans: every process nbdist started exits within 30 s of its kernel being SIGKILLed in
the middle of a cell, on both engines (the kernel here is a child Python process that starts a
cluster: controller or scheduler, engines or nannies and workers, the rendezvous store)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.timeout(180)

KERNEL = """
import sys, time
import nbdist

def main():
    nbdist.start(2, engine=sys.argv[1], timeout=60)
    nbdist.run_cell("x = rank")
    print("READY", flush=True)
    nbdist.run_cell("import time; time.sleep(600)")  # killed in the middle of this cell

if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("engine", ["ipyparallel", "dask"])
def test_every_process_exits_after_the_kernel_is_killed(engine, tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL)
    log = tmp_path / "kernel.log"
    with open(log, "w") as err:
        kernel = subprocess.Popen([sys.executable, str(script), engine],
                                  stdout=subprocess.PIPE, stderr=err, text=True)
    started: list[psutil.Process] = []
    try:
        assert kernel.stdout.readline().strip() == "READY", log.read_text()[-3000:]
        started = psutil.Process(kernel.pid).children(recursive=True)
        assert len(started) >= 3, "the cluster's processes should be running"
        kernel.kill()  # SIGKILL: no cleanup runs in the kernel
        kernel.wait()
        deadline = time.monotonic() + 30
        left = started
        while left and time.monotonic() < deadline:
            time.sleep(0.5)  # other processes' exits offer nothing to wait on from here
            left = [p for p in started if p.is_running()
                    and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, "still running 30 s after the kernel died: " + ", ".join(
            " ".join(p.cmdline()[:4]) for p in left)
    finally:
        kernel.kill()
        for p in started:
            try:
                p.kill()
            except psutil.Error:
                pass
