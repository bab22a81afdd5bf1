"""``%nbdist run``: a torchrun-style script in a fresh child process of the worker.

A child process gives the script what torchrun gives it (``__main__``, ``sys.argv``, no process
group yet) while the worker's warm state and group stay untouched. Its rendezvous store is
hosted by rank 0's worker, as torchrun's agent hosts it. As under torchrun, each rank gets its
own ``TORCHELASTIC_ERROR_FILE``: a ``@record``-decorated entry point writes its failure there,
and the notebook reports that recorded root cause.

Each rank's end is its script's exit status, sent as the rank's end event (the run's record
reads it as a cell's end): 0 finished, any other status failed with that status, a signal
named as torchrun names it (``exit code -9``: SIGKILL).

The child leads its own process session, so an interrupt or timeout stops the script and every
process it started (DataLoader workers, its own children), by process group.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

from ..telemetry.events import end, stream
from .capture import EventSink
from .results import CellResult, ErrorInfo, plain_error, script_result

# After SIGTERM, how long a script's processes get to exit before SIGKILL.
_TERM_GRACE = 3.0


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


def error_file(run_id: str, rank: int) -> str:
    """Where this rank's script records its failure, as torchrun lays it out per attempt."""
    return os.path.join(tempfile.gettempdir(), f"nbdist-{run_id}", "attempt_0", str(rank),
                        "error.json")


def recorded_error(path: str) -> Optional[ErrorInfo]:
    """The failure a ``@record`` entry point wrote to ``path``, or None."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)["message"]
        message = data["message"] if isinstance(data, dict) else str(data)
        extra = data.get("extraInfo", {}) if isinstance(data, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ename, _, evalue = str(message).partition(": ")
    try:
        when: Optional[float] = float(extra["timestamp"])
    except (KeyError, TypeError, ValueError):
        when = None
    return plain_error(ename or "Error", evalue or str(message),
                       str(extra.get("py_callstack", "")), timestamp=when)


def exit_words(code: int) -> str:
    """How a script's process ended: ``exited with status 3``, or for a signal
    ``killed by SIGKILL (exit code -9)`` (torchrun reports a signal as its number negated)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (exit code {code})"
    return f"exited with status {code}"


def _pump(pipe: Any, name: str, sink: EventSink) -> None:
    for line in iter(pipe.readline, ""):
        sink.emit(stream(name, line))
    pipe.close()


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the script's process group, then SIGKILL what is left after a grace."""
    for sig, wait in ((signal.SIGTERM, _TERM_GRACE), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(wait)
            if sig == signal.SIGTERM:
                # The leader is gone; its children may not be: one SIGKILL for the group.
                os.killpg(proc.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def _wait(proc: subprocess.Popen) -> int:
    """``proc.wait()`` in short slices: Dask interrupts a task thread with an asynchronous
    exception, which lands only between bytecodes, never inside one long blocking wait."""
    while True:
        try:
            return proc.wait(0.2)
        except subprocess.TimeoutExpired:
            continue


def run(script: str, source: str, argv: list[str], env: dict[str, str], cwd: str,
        sink: EventSink) -> CellResult:
    """Run the script with ``env`` (this rank's torchrun variables) and report how it ended."""
    path, tmp = _script_path(script, source)
    seq0 = sink.flush()
    child_env = dict(os.environ)
    child_env.update(env)
    child_env["PYTHONUNBUFFERED"] = "1"
    errors = env.get("TORCHELASTIC_ERROR_FILE")
    if errors:
        os.makedirs(os.path.dirname(errors), exist_ok=True)
        if os.path.exists(errors):
            os.remove(errors)
    if not os.path.isdir(cwd):
        cwd = os.path.dirname(path)
    proc = subprocess.Popen([sys.executable, path, *argv], cwd=cwd, env=child_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    pumps = [threading.Thread(target=_pump, args=(p, n, sink), daemon=True)
             for p, n in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for t in pumps:
        t.start()
    interrupted = False
    try:
        code = _wait(proc)
    except KeyboardInterrupt:  # interrupted or timed out: nothing it started may outlive it
        _stop_group(proc)
        code = proc.wait()
        interrupted = True
    finally:
        if proc.poll() is None:
            _stop_group(proc)
        for t in pumps:
            t.join(timeout=5)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    error: Optional[ErrorInfo] = None
    if code != 0 and not interrupted:
        error = (recorded_error(errors) if errors else None) or plain_error("ScriptError",
                                                                           exit_words(code))
    # The rank's end, as a cell's: its last event, so the run's record reads it last.
    said = (f"KeyboardInterrupt: stopped, {exit_words(code)}" if interrupted
            else f"{error['ename']}: {error['evalue']}" if error else None)
    sink.emit(end(code == 0 and not interrupted, time.time(), said))
    seq = sink.flush()
    result = script_result(code, interrupted, seq if seq > seq0 else 0)
    if error is not None:
        result["error"] = error
    if errors:
        shutil.rmtree(os.path.dirname(os.path.dirname(os.path.dirname(errors))),
                      ignore_errors=True)
    return result
