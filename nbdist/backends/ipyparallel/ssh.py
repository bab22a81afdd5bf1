"""ipyparallel's SSH engine launcher as nbdist runs it: stops in one SSH command per engine.

ipyparallel stops an engine over SSH with a signal, a wait, perhaps a second signal and a
second wait, then copies its log back and removes it: about seven SSH round trips per engine,
one engine after another (a quarter of a minute for two engines on a busy machine). Here an
engine's stop is one command on its host, run for every engine at once: SIGTERM to the
engine's session (the engine and the helper process it starts), up to :data:`STOP_GRACE`
seconds for it to end, then SIGKILL. The log stays in the cluster's directory on the host,
which nbdist removes with the cluster (or keeps, and names, when a start fails).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher

#: seconds an engine gets to end after SIGTERM before its session is killed
STOP_GRACE = 5.0

_STOP = """\
import os, signal, time
def gone(pid):
    try:
        os.kill(pid, 0)
        return open("/proc/%d/stat" % pid).read().split()[2] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        return True
    except PermissionError:
        return False
def send(pid, sig):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
pid = {pid}
send(pid, signal.SIGTERM)
deadline = time.time() + {grace}
while not gone(pid) and time.time() < deadline:
    time.sleep(0.05)
send(pid, signal.SIGKILL)
print("__stopped=1__")
"""

log = logging.getLogger(__name__)


class SSHEngine(SSHEngineLauncher):
    """One engine on an SSH host (its process leads a session of its own there)."""

    def get_output(self, remove: bool = False) -> str:
        if self._output is None:
            self._output = ""  # left in the cluster's directory on the host
        return self._output

    async def stop(self) -> Any:
        if self.state != "running":
            return None
        code = _STOP.format(pid=int(self.pid), grace=STOP_GRACE)
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, self.ssh_sender.check_output_python_code, code)
        except Exception as exc:  # the host is gone: so is the engine
            log.debug("stopping engine %s on %s: %r", self.pid, self.location, exc)
        stopping = getattr(self, "_stop_waiting", None)
        if stopping is not None:
            stopping.set()
        return self.notify_stop({"exit_code": None, "pid": self.pid,
                                 "identifier": self.identifier})


class SSHEngines(SSHEngineSetLauncher):
    """ipyparallel's SSH engine set, with :class:`SSHEngine` for each engine."""

    launcher_class = SSHEngine
