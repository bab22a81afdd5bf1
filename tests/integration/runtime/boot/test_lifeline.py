"""No orphans across hosts: a notebook kernel killed with SIGKILL in the middle of a cell leaves
nothing behind on a real Slurm or a real sshd, on both engines, within 60 s.

A real kernel (jupyter_client, this interpreter's ipykernel) starts the example profile and
runs a cell whose ranks sleep for ten minutes; once every rank is inside it, the kernel is
killed. Then every process the kernel started here (an ipyparallel controller, the rendezvous
store) must end, and so must everything the launcher started elsewhere: no job in ``squeue``,
no process of an ssh session. The workers there cannot watch the kernel by PID (a PID means
nothing on another host): they end because the controller or scheduler, which runs here and
ends with the kernel, is gone.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from realclusters import Site, describe, needs_engine, wait_until, write_profile

REPO = Path(__file__).resolve().parents[4]
GONE_WITHIN = 60.0

pytestmark = pytest.mark.timeout(300)


class Kernel:
    """A notebook kernel of this interpreter, started with jupyter_client."""

    def __init__(self, cwd: Path):
        from jupyter_client.manager import start_new_kernel

        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.km, self.kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(cwd))
        self.pid = self.km.provisioner.process.pid

    def run(self, code: str, timeout: float) -> str:
        """Run a cell and wait for it; its output, or an AssertionError with its error."""
        out: list[str] = []

        def hook(msg: dict) -> None:
            content = msg["content"]
            if msg["msg_type"] == "stream":
                out.append(content["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(content["traceback"]))

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)
        if reply["content"]["status"] != "ok":
            raise AssertionError(f"the kernel's cell failed:\n{''.join(out)[-4000:]}")
        return "".join(out)

    def close(self) -> None:
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=True)
        except Exception:  # killed already: its manager only has to let go
            pass


@pytest.mark.parametrize("engine", ["ipyparallel", "dask"])
def test_a_killed_kernel_leaves_nothing_on_the_cluster(site: Site, engine, tmp_path):
    needs_engine(engine, site.launcher)
    profile = write_profile(tmp_path, site, engine)
    marks = tmp_path / "marks"
    marks.mkdir()
    kernel = Kernel(tmp_path)
    mine: list[psutil.Process] = []
    try:
        kernel.run(f"import nbdist\ns = nbdist.start(profile={str(profile)!r})\n"
                   "s.run_cell('x = rank', output='quiet')", timeout=180)
        # Mid-cell: every rank sleeps (an ipyparallel engine's own heartbeat check would not
        # run before the cell ends; a Dask worker's task thread is busy).
        cell = (f"import os, time\nopen(os.path.join({str(marks)!r}, str(rank)), 'w').close()\n"
                "time.sleep(600)")
        kernel.kc.execute(f"s.run_cell({cell!r})")
        wait_until(lambda: len(list(marks.iterdir())) == 2, 60, "every rank to be in the cell")
        mine = psutil.Process(kernel.pid).children(recursive=True)
        remote = site.leftovers()
        assert remote, "the launcher should hold the workers"
        t0 = time.monotonic()
        os.kill(kernel.pid, signal.SIGKILL)

        def gone() -> bool:
            return not site.leftovers() and not [p for p in mine if _alive(p)]

        try:
            wait_until(gone, GONE_WITHIN, "nothing of the cluster to be left")
        except AssertionError:
            raise AssertionError(
                f"{GONE_WITHIN:g} s after the kernel's SIGKILL, still there: "
                f"{site.leftovers()} {[describe(p) for p in mine if _alive(p)]}") from None
        print(f"{site.launcher} x {engine}: everything gone {time.monotonic() - t0:.1f} s "
              f"after the kernel's SIGKILL (was: {len(remote)} on the cluster, "
              f"{len(mine)} here)")
    finally:
        kernel.close()
        for p in mine:
            if _alive(p):
                p.kill()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
