"""The hang doctor on a worker: notice that the running cell makes no progress, and say where
it is.

While a cell runs, :data:`watch` knows the thread running it, when the cell last made progress
(a step or collective completed, a progress bar moved: :mod:`.model` tells it) and which
``torch.distributed`` collective the cell is inside right now (the collective wrappers of
:mod:`.ddp_hooks` record it on entry: a few attribute stores, nothing allocated). The event
sink's thread, which wakes ten times a second anyway, calls :meth:`Watch.tick`: once the cell
has made no progress for half the stall threshold
(:func:`~nbdist.telemetry.stall.thresholds.probe_after`), or for a second inside a collective
or torch's code, it samples the cell thread's Python stack (``sys._current_frames()``) at most
once a second and sends it as a ``stack`` event when it changed: a rank that waits in a
collective says so early enough for the notebook to end the cell at once when a peer that
finished will never join it. An interrupt (a timeout or the stop button) makes it sample
once more *before* the interrupt unwinds or severs the cell (:func:`.interrupt.set_hook`), so
the error the notebook raises says where each rank was.

Kept from a stack: the cell's own frames (their line numbers are the editor's, as tracebacks'
are) and the innermost frame, with the call expression it is in (``time.sleep(0.05)``). Added:
the tail of torch's Flight Recorder where torch has one (op, the group's sequence number,
sizes, state), enabled for every group nbdist forms (:func:`enable_flight_recorder`); torch
2.13 records gloo's collectives too. Nothing here opens a socket: the Flight Recorder is read
in-process and the stacks travel on the event channel.

Stdlib only; torch is looked up in ``sys.modules`` (the notebook imports this module through
:mod:`.model`).
"""

from __future__ import annotations

import linecache
import os
import pickle
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Optional

from ...telemetry import events as ev
from ...telemetry.stall.thresholds import STALL_WINDOW, probe_after, stall_threshold
from .. import interrupt

#: at most one stack sample per this many seconds while a cell is stalled
SAMPLE_S = 1.0
#: seconds without progress inside a collective (or torch's code) before the first sample,
#: whatever the threshold: a peer that finished the cell never joins it, and the notebook
#: ends such a cell as soon as it knows (``StallWatch.stranded``) ...
COLLECTIVE_PROBE_S = 1.0
#: ... or this many median steps, when steps are longer (a long step's own wait is no news)
COLLECTIVE_PROBE_STEPS = 2.0
#: seconds the cell's SIGINT handler waits for the report another thread is writing of the
#: same interrupt (a deadlock guard: that thread may wait for a lock the cell's thread holds)
REPORT_WAIT_S = 1.0
#: Flight Recorder entries per process (torch's ring buffer), unless the user set a size
FLIGHT_RECORDER_ENTRIES = 2000
#: finished Flight Recorder entries sent with a stack (the unfinished ones always are)
FLIGHT_TAIL = 3
#: torch's Flight Recorder dumps: gloo's (and other CPU backends'), NCCL's
_FR_DUMPS = ("_dump_fr_trace", "_dump_nccl_trace")
#: characters of a call expression or a line kept
_TEXT = 160
# Frames of this module and of the interrupt watcher are the sampler's, never the cell's.
_OURS = {os.path.splitext(os.path.abspath(m.__file__ or ""))[0]
         for m in (sys.modules[__name__], interrupt)}


class Watch:
    """Per-process state of the hang doctor; one instance, :data:`watch`."""

    def __init__(self) -> None:
        self.sink: Any = None
        self.thread: Optional[int] = None  # ident of the thread running the cell
        self.filename = ""
        self.sampling = False  # periodic stall samples on (telemetry on, not switched off)
        self.override: Optional[float] = None
        self.last_progress = 0.0  # time.monotonic()
        self.started_ns = 0  # time.time_ns() at the cell's start (Flight Recorder's clock)
        self.steps: deque[float] = deque(maxlen=STALL_WINDOW)
        self._threshold: Optional[float] = None  # stall_threshold of steps (0.0: off)
        self._early = COLLECTIVE_PROBE_S  # the first sample inside a collective, with it
        self.calls: dict[str, int] = {}  # op -> collectives of it entered in this cell
        # the collective the cell is inside now (op None: none)
        self.op: Optional[str] = None
        self.seq = 0
        self.nbytes = 0
        self.dtype = ""
        self.since = 0.0
        self._next = 0.0
        self._last_key: Optional[tuple] = None
        self._interrupted = False
        self._lock = threading.Lock()
        #: set once the interrupt's report is in the sink (see :meth:`capture_interrupt`)
        self._reported = threading.Event()
        #: where the cell stands while a debugger (or ``input()``) waits for the notebook
        self.held: Optional[FrameType] = None

    # ------------------------------------------------------------- cell lifecycle
    def begin(self, sink: Any, filename: str, sampling: bool = True,
              stall_after: Optional[float] = None) -> None:
        """A cell starts on this thread; ``stall_after`` is the user's threshold (0: off)."""
        self.sink, self.filename = sink, filename
        self.thread = threading.get_ident()
        self.override = stall_after
        self.sampling = sampling and stall_after != 0
        self.last_progress = time.monotonic()
        self.started_ns = time.time_ns()
        self.steps.clear()
        self._threshold = None
        self.calls.clear()
        self.op = None
        self._next = 0.0
        self._last_key = None
        self._interrupted = False
        self._reported.clear()
        self.held = None
        if sink is not None:
            sink.on_tick = self.tick
        interrupt.set_hook(self.capture_interrupt)

    def end(self) -> None:
        """The cell is over: no more samples."""
        interrupt.set_hook(None)
        sink, self.sink = self.sink, None
        if sink is not None and getattr(sink, "on_tick", None) == self.tick:
            sink.on_tick = None
        self.thread = None
        self.op = None
        self.held = None

    def hold(self, frame: Optional[FrameType]) -> Optional[FrameType]:
        """The cell stopped at ``frame`` for the debugger: time spent there is no stall (no
        samples), and an interrupt reports ``frame``, not the debugger's own. Returns what
        was held before, for :meth:`release` (a prompt inside the debugger nests)."""
        before, self.held = self.held, frame
        return before

    def release(self, before: Optional[FrameType]) -> None:
        """The debugger let the cell run again: its clock of progress starts now."""
        self.held = before
        self.last_progress = time.monotonic()

    # ------------------------------------------------------------- hot path (any thread)
    def progress(self) -> None:
        """The cell made progress now."""
        self.last_progress = time.monotonic()

    def step(self, seconds: float) -> None:
        """A step took ``seconds`` (its length sets the threshold; its end was a
        :meth:`progress`). Called when its event is built, on the sending thread."""
        self.steps.append(seconds)
        self._threshold = None

    def enter(self, op: str, nbytes: int, dtype: str, t0: float) -> None:
        """The cell enters collective ``op`` (``nbytes`` of ``dtype``) at ``t0``."""
        n = self.calls.get(op, 0) + 1
        self.calls[op] = n
        self.seq, self.nbytes, self.dtype, self.since = n, nbytes, dtype, t0
        self.op = op  # last: a sampler that sees the op sees its details

    def leave(self) -> None:
        """The collective entered last returned (or raised)."""
        self.op = None
        self.last_progress = time.monotonic()

    # ------------------------------------------------------------- sampling
    def tick(self) -> None:
        """Called by the event sink's thread about ten times a second: sample the cell's
        stack when it has made no progress for a while (at most every :data:`SAMPLE_S`)."""
        if not self.sampling or self.thread is None or self.held is not None:
            return
        now = time.monotonic()
        if now < self._next:
            return
        threshold = self._threshold
        if threshold is None:  # recomputed after new steps only: a median of the window
            threshold = self._threshold = stall_threshold(self.steps, self.override) or 0.0
            median = statistics.median(self.steps) if self.steps else 0.0
            self._early = max(COLLECTIVE_PROBE_S, COLLECTIVE_PROBE_STEPS * median)
        if not threshold:
            return
        idle = now - self.last_progress
        if idle < probe_after(threshold) and not (idle >= self._early and self._in_torch()):
            return
        self._next = now + SAMPLE_S
        self._sample("stall", None, idle, force=False)

    def _in_torch(self) -> bool:
        """The cell is inside a collective (nbdist's record of the call), or in torch's
        code, where a collective DDP's reducer started may be waited for (the Flight
        Recorder, read by the sample, says whether it is)."""
        if self.op is not None:
            return True
        frame = sys._current_frames().get(self.thread) if self.thread is not None else None
        return frame is not None and str(frame.f_globals.get("__name__", "")).startswith("torch.")

    def capture_interrupt(self, frame: Optional[FrameType] = None) -> None:
        """An interrupt is on its way: send where the cell is, once per cell, before it lands.

        ``frame`` is the cell thread's current frame when the caller has it (the SIGINT
        handler runs in that thread); else it is looked up.
        """
        with self._lock:
            first = self.thread is not None and not self._interrupted
            self._interrupted = self._interrupted or first
        if not first:
            # Another thread (the interrupt's watcher) is writing the report: the cell's own
            # SIGINT handler waits for it, briefly, so that the report is sent before the
            # cell's end rather than after its last batch
            if self.thread is not None:
                self._reported.wait(REPORT_WAIT_S)
            return
        try:
            self._sample("interrupt", frame, time.monotonic() - self.last_progress, force=True)
        finally:
            self._reported.set()

    def _sample(self, reason: str, frame: Optional[FrameType], idle: float,
                force: bool) -> None:
        sink, thread = self.sink, self.thread
        if sink is None or thread is None:
            return
        if self.held is not None:  # stopped in the debugger: where the cell stands, not pdb
            frame = self.held
        elif frame is None:
            frame = sys._current_frames().get(thread)
        if frame is None:
            return
        frames = stack_frames(frame, self.filename)
        op = self.op
        collective = None
        if op is not None:
            collective = {"op": op, "seq": self.seq, "bytes": self.nbytes, "dtype": self.dtype,
                          "since": self.since}
        flight = flight_recorder(self.started_ns)
        key = (tuple((f["file"], f["line"]) for f in frames), op, self.seq if op else None,
               tuple((e["group"], e["seq"], e["done"]) for e in flight or ()))
        if not force and key == self._last_key:
            return  # the same place as last time: the notebook already has it
        self._last_key = key
        sink.emit(ev.stack(time.time(), reason, idle, frames, collective=collective,
                           flight=flight, calls=dict(self.calls)))


watch = Watch()


@contextmanager
def watching(sink: Any, filename: str, sampling: bool = True,
             stall_after: Optional[float] = None) -> Iterator[Watch]:
    """Watch the cell that runs in this block on this thread (see :class:`Watch`)."""
    watch.begin(sink, filename, sampling, stall_after)
    try:
        yield watch
    finally:
        watch.end()


# ----------------------------------------------------------------- stacks
def _ours(filename: str) -> bool:
    return os.path.splitext(os.path.abspath(filename))[0] in _OURS


def _qualname(frame: FrameType) -> str:
    code = frame.f_code
    name = getattr(code, "co_qualname", code.co_name)
    module = frame.f_globals.get("__name__")
    return f"{module}.{name}" if module and not name.startswith("<") else name


def call_text(frame: FrameType) -> Optional[str]:
    """The call expression ``frame`` is executing (``time.sleep(0.05)``), from the positions
    Python 3.11+ keeps per instruction; None where they are not known."""
    code = frame.f_code
    positions = getattr(code, "co_positions", None)
    if positions is None or frame.f_lasti < 0:
        return None
    try:
        first, last, col0, col1 = list(positions())[frame.f_lasti // 2]
    except (IndexError, ValueError):
        return None
    if None in (first, last, col0, col1):
        return None
    lines = [linecache.getline(code.co_filename, n).encode() for n in range(first, last + 1)]
    if not any(lines):
        return None
    if first == last:
        text = lines[0][col0:col1]
    else:  # offsets are bytes of UTF-8, per line
        text = lines[0][col0:] + b"".join(lines[1:-1]) + lines[-1][:col1]
    out = " ".join(text.decode("utf-8", "replace").split())
    return out[:_TEXT] or None


def stack_frames(frame: FrameType, filename: str) -> list[dict[str, Any]]:
    """``frame``'s stack as the hang doctor sends it: the cell's frames (``filename``) and the
    innermost frame, outermost first. The sampler's own frames are dropped."""
    chain: list[FrameType] = []
    f: Optional[FrameType] = frame
    while f is not None:
        chain.append(f)
        f = f.f_back
    while chain and _ours(chain[0].f_code.co_filename):
        chain.pop(0)  # a SIGINT handler or sampler of ours on top of the cell's frames
    if not chain:
        return []
    out = []
    innermost = chain[0]
    for f in reversed(chain):
        is_cell = f.f_code.co_filename == filename
        if not (is_cell or f is innermost):
            continue
        line = f.f_lineno or 0
        out.append({"file": f.f_code.co_filename, "line": line,
                    "name": f.f_code.co_name if is_cell else _qualname(f), "cell": is_cell,
                    "code": linecache.getline(f.f_code.co_filename, line).strip()[:_TEXT],
                    "call": call_text(f) if f is innermost or is_cell else None})
    return out


# ----------------------------------------------------------------- torch's Flight Recorder
def enable_flight_recorder() -> None:
    """Have torch's Flight Recorder keep the last collectives of every process group formed
    from now on (it reads the size when the first group is made), unless the user chose a
    size (``TORCH_FR_BUFFER_SIZE``, or NCCL's older ``TORCH_NCCL_TRACE_BUFFER_SIZE``)."""
    if "TORCH_FR_BUFFER_SIZE" not in os.environ and \
            "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(FLIGHT_RECORDER_ENTRIES)


def _recording() -> bool:
    size = os.environ.get("TORCH_FR_BUFFER_SIZE",
                          os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0"))
    try:
        return int(size) > 0
    except ValueError:
        return False


def flight_recorder(since_ns: int = 0) -> Optional[list[dict[str, Any]]]:
    """The Flight Recorder's entries created since ``since_ns`` (``time.time_ns()``): the
    unfinished ones and the last :data:`FLIGHT_TAIL` finished ones, oldest first. None where
    torch has no Flight Recorder or it records nothing."""
    c10d = sys.modules.get("torch._C._distributed_c10d")
    # Two recorders: the one gloo's groups write (_dump_fr_trace), and NCCL's, which keeps
    # CUDA events (_dump_nccl_trace, in CUDA builds). An entry both returned counts once.
    dumps = [d for d in (getattr(c10d, n, None) for n in _FR_DUMPS) if d is not None]
    if not dumps or not _recording():
        return None
    entries: dict[tuple, dict[str, Any]] = {}
    read = False
    for dump in dumps:
        try:
            raw = pickle.loads(dump(includeCollectives=True, includeStackTraces=False,
                                    onlyActive=False))
        except Exception:  # a torch without it for this backend, or a dump that failed
            continue
        read = True
        for e in raw.get("entries") or ():
            entries.setdefault((str(e.get("process_group")), e.get("record_id"),
                                e.get("time_created_ns")), e)
    if not read:
        return None
    out = []
    for e in sorted(entries.values(), key=lambda e: e.get("time_created_ns") or 0):
        if (e.get("time_created_ns") or 0) < since_ns:
            continue  # an earlier cell's
        name = str(e.get("profiling_name", "?"))
        group = e.get("process_group") or ("?", "?")
        p2p = bool(e.get("is_p2p"))
        state = str(e.get("state", ""))
        out.append({"group": str(group[1] or group[0]) if isinstance(group, (tuple, list))
                    else str(group),
                    "op": name.split(":", 1)[-1],
                    "seq": e.get("p2p_seq_id") if p2p else e.get("collective_seq_id"),
                    "sizes": [list(s) for s in e.get("input_sizes") or ()][:8],
                    "dtypes": [str(d) for d in e.get("input_dtypes") or ()][:8],
                    "state": state, "done": bool(e.get("retired")) or state == "completed",
                    "p2p": p2p})
    done = [e for e in out if e["done"]][-FLIGHT_TAIL:]
    return [e for e in out if not e["done"] or e in done]
