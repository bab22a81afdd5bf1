"""``%nbdist run``: a torchrun-style script in a fresh child process of the worker.

A child process gives the script what torchrun gives it (``__main__``, ``sys.argv``, no process
group yet) while the worker's warm state and group stay untouched. Its rendezvous store is
hosted by rank 0's worker, as torchrun's agent hosts it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from typing import Any, Optional

from ..telemetry.events import stream
from .capture import EventSink
from .results import CellResult, script_result


def _script_path(script: str, source: str) -> tuple[str, Optional[str]]:
    """Use the script where it is if this host has the same file, else a private copy."""
    try:
        with open(script, encoding="utf-8") as f:
            if f.read() == source:
                return script, None
    except OSError:
        pass
    tmp = tempfile.mkdtemp(prefix="nbdist-run-")
    path = os.path.join(tmp, os.path.basename(script))
    with open(path, "w", encoding="utf-8") as f:
        f.write(source)
    return path, tmp


def _pump(pipe: Any, name: str, sink: EventSink) -> None:
    for line in iter(pipe.readline, ""):
        sink.emit(stream(name, line))
    pipe.close()


def run(script: str, source: str, argv: list[str], env: dict[str, str], cwd: str,
        sink: EventSink) -> CellResult:
    path, tmp = _script_path(script, source)
    seq0 = sink.flush()
    child_env = dict(os.environ)
    child_env.update(env)
    child_env["PYTHONUNBUFFERED"] = "1"
    if not os.path.isdir(cwd):
        cwd = os.path.dirname(path)
    proc = subprocess.Popen([sys.executable, path, *argv], cwd=cwd, env=child_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    pumps = [threading.Thread(target=_pump, args=(p, n, sink), daemon=True)
             for p, n in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for t in pumps:
        t.start()
    interrupted = False
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # interrupted or timed out: the child must not outlive the request
        proc.kill()
        code = proc.wait()
        interrupted = True
    finally:
        for t in pumps:
            t.join(timeout=5)
        if tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    seq = sink.flush()
    return script_result(code, interrupted, seq if seq > seq0 else 0)
