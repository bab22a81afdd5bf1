"""``%nbdist run``: a torchrun-style script in a fresh child process of the worker.

A child process gives the script what torchrun gives it (``__main__``, ``sys.argv``, no process
group yet) while the worker's warm state and group stay untouched. Its rendezvous store is
hosted by rank 0's worker, as torchrun's agent hosts it. As under torchrun, each rank gets its
own ``TORCHELASTIC_ERROR_FILE``: a ``@record``-decorated entry point writes its failure there,
and the notebook reports that recorded root cause.

Each rank's end is its script's exit status, sent as the rank's end event (the run's record
reads it as a cell's end): 0 finished, any other status failed with that status, a signal
named as torchrun names it (``exit code -9``: SIGKILL).

The script reports as a cell's ranks do: its process starts with ``python -m nbdist.agent``
and :data:`~nbdist.agent.wire.RUN_SPOOL_ENV` set, so the agent's rank (:mod:`nbdist.agent.rank`)
measures it with the workers' instruments (DDP steps, collectives, memory, ``tqdm`` and
``nbdist.progress`` bars, what training libraries log) and writes its batches to a spool
directory of the worker's (:mod:`nbdist.agent.spool`), never a socket. :class:`Relay` reads
them there and hands their events to the worker's sink as the rank's.

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

from ..agent import wire
from ..agent.spool import SpoolReader
from ..telemetry.columns import unpack
from ..telemetry.events import END, end, stream
from .capture import EventSink
from .results import CellResult, ErrorInfo, plain_error, script_result

# After SIGTERM, how long a script's processes get to exit before SIGKILL.
_TERM_GRACE = 3.0
#: seconds between the relay's looks at the script's spool
RELAY_POLL = 0.1


class Relay:
    """The script's telemetry, from its process's spool to the worker's ``sink``.

    The script's rank agent writes its batches to :attr:`directory` (a fresh one, removed at
    :meth:`close`); a thread reads them every :data:`RELAY_POLL` seconds and emits their
    events into ``sink``, so they leave the worker as the rank's, in the worker's batches.
    The script's own end event is left out: the worker reports the rank's end from the
    script's exit status."""

    def __init__(self, sink: EventSink) -> None:
        self.sink = sink
        self.directory = tempfile.mkdtemp(prefix="nbdist-run-events-")
        self.reader = SpoolReader(self.directory)
        self.relayed = 0  # events handed to the sink
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nbdist-script-events",
                                        daemon=True)

    def env(self) -> dict[str, str]:
        """What the script's environment needs for its agent to write here."""
        return {wire.RUN_SPOOL_ENV: self.directory}

    def start(self) -> Relay:
        self._thread.start()
        return self

    def pump(self) -> int:
        """Relay what the script wrote since the last call; the number of events."""
        n = 0
        for _pid, frame in self.reader.read():
            try:
                msg = wire.decode(frame[4:])
            except ValueError:
                continue
            if msg.get("type") != "batch":  # who the rank is, how it exited: the worker knows
                continue
            for event in unpack(msg["batch"].get("events", ())):
                if event.get("kind") != END:
                    self.sink.emit(event)
                    n += 1
        self.relayed += n
        return n

    def _loop(self) -> None:
        while not self._stop.wait(RELAY_POLL):
            try:
                self.pump()
            except Exception as exc:  # a telemetry bug must not change how the script runs
                sys.__stderr__.write(f"nbdist: could not relay the script's telemetry: "
                                     f"{exc!r}\n")
                return

    def close(self) -> None:
        """Relay the rest (the script has exited: all it wrote is there) and remove the
        directory."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self.pump()
        except Exception as exc:
            sys.__stderr__.write(f"nbdist: could not relay the script's telemetry: {exc!r}\n")
        shutil.rmtree(self.directory, ignore_errors=True)


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
    relay = Relay(sink)
    child_env.update(relay.env())
    try:  # the agent runs the script as __main__ with the sys.argv it would have run directly
        proc = subprocess.Popen([sys.executable, "-m", "nbdist.agent", path, *argv], cwd=cwd,
                                env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    except BaseException:
        relay.close()
        raise
    relay.start()
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
        relay.close()
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
