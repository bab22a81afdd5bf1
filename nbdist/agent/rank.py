"""One rank of a job started outside the notebook, reporting as a ``%%distributed`` cell does.

The rank measures with the workers' own instruments, installed as a worker installs them when
it joins (:mod:`nbdist.runtime.measure`: DDP and collective timing, optimizer steps, memory,
``tqdm`` loops, ``nbdist.progress``), and its whole life is one cell: the batches of its
:class:`~nbdist.runtime.capture.EventSink` go to the node's forwarder through the spool
(:mod:`.spool`), never to a socket, and the training thread pays what a cell pays. At exit it
reports its open step, its memory and its end (the error that ended it, if one did).
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Optional

from ..runtime.capture import EventSink
from ..telemetry import events
from . import wire
from .spool import SpoolWriter, read_commands

#: seconds between a rank's looks for the notebook's commands
COMMAND_POLL = 0.2
#: files whose frames are the agent's, not the script's (left out of a stack)
_OURS = os.path.join("nbdist", "agent", "")


def _runpy(filename: str) -> bool:
    # Python 3.11 on names the frozen module "<frozen runpy>", earlier ones its file
    return filename == "<frozen runpy>" or os.path.basename(filename) == "runpy.py"


def script_frames(frames: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """The script's part of a rank's stack: the agent's frames left out, and the frames of
    :mod:`runpy` that run the agent and the script (``-m nbdist.agent``) before the script's
    first frame (a script's own later use of runpy is kept)."""
    kept = [f for f in frames if _OURS not in f.filename]
    first = 0
    while first < len(kept) and _runpy(kept[first].filename):
        first += 1
    return kept[first:]


def main_stack() -> str:
    """The main thread's Python stack now, outermost first, as a traceback prints it (taken
    from another thread: a main thread in a collective or a sleep has released the GIL)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "(the main thread has no Python frame)"
    return "".join(traceback.format_list(script_frames(traceback.extract_stack(frame))))


def script_path(argv: list[str]) -> str:
    """The file a rank started as ``python SCRIPT`` runs, as its code objects name it (an
    absolute path); "" where it runs no file (``-c``, ``-m``, a prompt)."""
    first = argv[0] if argv else ""
    if not first or first.startswith("-") or not os.path.isfile(first):
        return ""
    return os.path.abspath(first)


def _int(env: Any, *names: str, default: int = 0) -> int:
    for name in names:
        value = env.get(name)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return default


def identity(env: Any) -> dict[str, Any]:
    """This rank as the launcher describes it (torchrun, Slurm's ``srun``, Open MPI, PMI)."""
    return {
        "rank": _int(env, "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"),
        "world_size": _int(env, "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
                           "PMI_SIZE", default=1),
        "local_rank": _int(env, "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"),
        "restart": _int(env, "TORCHELASTIC_RESTART_COUNT"),
    }


class RankAgent:
    """What one rank process reports, from :meth:`start` to its exit."""

    def __init__(self, spool_dir: str, env: Any = os.environ):
        self.env = env
        self.who = identity(env)
        self.job = wire.job_key(env) or f"host-{socket.gethostname()}-{os.getppid()}"
        self.writer = SpoolWriter(spool_dir)
        self.error: Optional[str] = None
        self.failed_at: Optional[float] = None  # when the error was raised (time.time())
        self.sink: Optional[EventSink] = None
        self._dropped_said = 0
        self._ended = False
        self.exit_status: Optional[int] = None  # what sys.exit was asked for, if called
        self.status_recorded = False  # the C library writes the process's exit status

    def _send(self, message: dict[str, Any], droppable: bool = True) -> bool:
        return self.writer.write(wire.encode(message), droppable)

    def _transport(self, batch: dict[str, Any]) -> None:
        self._send({"type": "batch", "job": self.job, "batch": batch})
        if self.writer.dropped != self._dropped_said:
            self._dropped_said = self.writer.dropped
            self._send({"type": "dropped", "job": self.job, "rank": self.who["rank"],
                        "where": "rank", "count": self.writer.dropped}, droppable=False)

    def start(self, measure: bool = True) -> RankAgent:
        """Say who this rank is, and start measuring (``measure`` False: its output's end
        only, without importing torch)."""
        self._send({"type": "rank", "job": self.job, **self.who, "host": socket.gethostname(),
                    "pid": os.getpid(), "t": time.time()}, droppable=False)
        self.sink = EventSink(self.who["rank"], self._transport,
                              events.flush_interval(self.who["world_size"]))
        if measure:
            from ..runtime.measure import ddp_hooks, tqdm_bars
            from ..runtime.measure.model import measurements

            ddp_hooks.install()
            tqdm_bars.install()
            measurements.begin_cell(self.sink)
            self._watch()
        hook = sys.excepthook

        def excepthook(kind: type, value: BaseException, tb: Any) -> None:
            self.failed(value)
            hook(kind, value, tb)

        sys.excepthook = excepthook
        # SystemExit never reaches the excepthook, and Python calls atexit without the exit
        # status: the status the main thread asks for is kept here, as the process ends with
        # it (a script that catches its own SystemExit and goes on is the rare exception).
        exit_ = sys.exit

        def exit(status: Any = None) -> None:
            if threading.current_thread() is threading.main_thread():
                self.exiting(status)
            exit_(status)

        sys.exit = exit
        # ... nor a `raise SystemExit(3)` of the script's own: the status the process exits
        # with is written at its C exit, and its end read with it (see .spool)
        self.status_recorded = self.writer.record_exit_status()
        atexit.register(self.end)
        seen: set[str] = set()
        read_commands(self.writer.directory, seen)  # those before this process are not its
        threading.Thread(target=self._commands, args=(seen,), name="nbdist-commands",
                         daemon=True).start()
        return self

    def _watch(self) -> None:
        """The hang doctor's look at the main thread, as a cell's worker has it: the event
        sink's thread samples the script's stack once it makes no progress for a while (the
        training thread pays only the progress marks it pays anyway), and torch's Flight
        Recorder keeps the groups' collectives (it must be on before the script forms one)."""
        from ..runtime.measure.stall_probe import enable_flight_recorder, watch

        enable_flight_recorder()
        watch.begin(self.sink, script_path(sys.argv))
        watch.thread = threading.main_thread().ident  # the script's, whoever starts the agent

    def script(self, path: str) -> None:
        """The script runs from ``path``, as its code names it (``python -m nbdist.agent``
        runs it with :func:`runpy.run_path`, which keeps the path as given): the hang doctor
        places ranks at its lines."""
        from ..runtime.measure.stall_probe import watch

        if watch.sink is not None and watch.sink is self.sink:
            watch.filename = path

    def _commands(self, seen: set[str]) -> None:
        """Answer the notebook's commands until the rank ends: a request for stacks gets the
        main thread's stack."""
        while not self._ended:
            time.sleep(COMMAND_POLL)
            for msg in read_commands(self.writer.directory, seen):
                if msg.get("job") not in (None, self.job):
                    continue
                if msg.get("rank") not in (None, self.who["rank"]):
                    continue
                asked = msg.get("ranks")
                if isinstance(asked, list) and self.who["rank"] not in asked:
                    continue  # the notebook asks the ranks it knows to run only
                if msg.get("type") == "stacks" and not self._ended:
                    self._send({"type": "stacks", "job": self.job, "rank": self.who["rank"],
                                "id": msg.get("id"), "pid": os.getpid(),
                                "text": main_stack(), "t": time.time()}, droppable=False)

    def failed(self, exc: BaseException) -> None:
        """The script ended with ``exc`` (reported as the rank's error at its end)."""
        tb = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        self.error = tb.splitlines()[-1] if tb else type(exc).__name__
        self.failed_at = time.time()

    def exiting(self, status: Any) -> None:
        """The script asked to end with ``status`` (``sys.exit``'s argument: None or 0 is
        success, another number the exit status, anything else is printed and gives 1)."""
        if status is None or status == 0:
            self.exit_status = 0
        elif isinstance(status, int):
            self.exit_status = status
        else:
            self.exit_status = 1
            self.error, self.failed_at = f"exited: {status}", time.time()

    def end(self, code: Optional[int] = None) -> None:
        """The rank's process ends: its last step, memory and end, then its exit frame.
        ``code``: its exit status where known (not 0: failed); None: the status
        :meth:`exiting` kept, else the one the process exits with, read by the forwarder
        once the process has ended (the script returned, or raised ``SystemExit`` itself)."""
        if self._ended or self.sink is None:
            return
        self._ended = True
        said = code is not None or self.exit_status is not None
        if code is None:
            code = self.exit_status
        if code and self.error is None:
            self.error, self.failed_at = f"exited with status {code}", time.time()
        try:
            from ..runtime.measure.model import measurements
            from ..runtime.measure.stall_probe import watch

            if watch.sink is self.sink:
                watch.end()
            if measurements.sink is self.sink:
                measurements.end_cell()
        except Exception as exc:  # a telemetry bug must not change how the script ends
            sys.__stderr__.write(f"nbdist: telemetry error: {exc!r}\n")
        ok = self.error is None
        self.sink.emit(events.end(ok, time.time(), self.error))
        self.sink.close()
        frame = {"type": "exit", "job": self.job, "rank": self.who["rank"],
                 "pid": os.getpid(), "ok": ok, "error": self.error, "lost": False,
                 "failed_at": self.failed_at, "t": time.time()}
        if ok and not said and self.status_recorded:
            self.writer.end_aside(wire.encode(frame))
        else:
            self._send(frame, droppable=False)
        self.writer.close()
