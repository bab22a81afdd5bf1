"""How an interrupt reaches a cell on a worker, including one blocked inside a collective.

Engines that run the cell in the worker's main thread (ipyparallel) interrupt it with SIGINT.
Engines that run it in a pool thread (Dask) register that thread with :func:`register_call`
and interrupt it with :func:`interrupt_calls`, which raises KeyboardInterrupt in it as an
asynchronous exception.

Python runs a signal handler, or an asynchronous exception, only between bytecodes, so a rank
blocked in a gloo or NCCL wait would ignore an interrupt until the collective's own timeout
(minutes). A watcher thread notices the interrupt instead — through the signal wakeup fd for
SIGINT, or through :func:`request` — and, if the cell is still running after a short grace,
cuts this rank's connections to its peers: the collective fails at once and the interrupt
lands.

Before an interrupt lands or the connections are cut, a hook (:func:`set_hook`, the hang
doctor's) is told, so it can note where the cell was while its stack is still whole: from the
watcher thread, from a SIGINT handler in the cell's own thread, or from the thread that raises
the interrupt by thread.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Callable, Optional

# How long an interrupted cell may take to stop by itself before its connections are cut.
GRACE = 1.0
_REQUEST = b"!"
# Told of an interrupt before it lands, with the interrupted frame when known.
_hook: Optional[Callable[[Optional[FrameType]], None]] = None


def set_hook(hook: Optional[Callable[[Optional[FrameType]], None]]) -> None:
    """Call ``hook`` (from any thread) when an interrupt is about to reach the running cell,
    before it unwinds or is cut loose; None removes it."""
    global _hook
    _hook = hook


def _before_interrupt(frame: Optional[FrameType] = None) -> None:
    hook = _hook
    if hook is not None:
        try:
            hook(frame)
        except Exception as exc:  # a diagnosis must never stand in the interrupt's way
            sys.__stderr__.write(f"nbdist: could not note where the cell was: {exc!r}\n")


class _Watcher:
    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.idle = threading.Event()  # clear while a cell runs on this worker
        self.idle.set()
        self.severed = False
        self.forward_fd = -1  # the wakeup fd we displaced, which still gets its bytes
        self.sever: Optional[Callable[[], None]] = None
        threading.Thread(target=self._loop, name="nbdist-interrupt", daemon=True).start()

    def _loop(self) -> None:
        while True:
            select.select([self.read_fd], [], [])
            data = os.read(self.read_fd, 512)
            if self.forward_fd >= 0:
                try:
                    os.write(self.forward_fd, data)
                except OSError:
                    pass
            wanted = _REQUEST in data or bytes([signal.SIGINT]) in data
            if wanted and not self.idle.is_set():
                _before_interrupt()  # while the cell's stack is still whole
            # idle.wait returns at once when no cell runs, or as soon as the cell ends.
            if wanted and not self.idle.wait(GRACE):
                sever = self.sever
                if sever is not None:
                    self.severed = True
                    sever()


_watcher: Optional[_Watcher] = None
_lock = threading.Lock()


def _get() -> _Watcher:
    global _watcher
    with _lock:
        if _watcher is None:
            _watcher = _Watcher()
        return _watcher


@contextmanager
def interruptible(sever: Callable[[], None]) -> Iterator[_Watcher]:
    """Run a cell so that an interrupt reaches it even inside a collective.

    ``sever`` cuts the rank's peer connections; it is called from the watcher thread. The
    yielded watcher's ``severed`` says whether it was called during the block.
    """
    w = _get()
    w.sever, w.severed = sever, False
    in_main = threading.current_thread() is threading.main_thread()
    previous = -1
    handler = None
    if in_main:
        previous = signal.set_wakeup_fd(w.write_fd, warn_on_full_buffer=False)
        w.forward_fd = previous
        handler = _noting_handler(signal.getsignal(signal.SIGINT))
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
    w.idle.clear()
    try:
        yield w
    finally:
        w.idle.set()
        if in_main:
            signal.set_wakeup_fd(previous, warn_on_full_buffer=False)
            w.forward_fd = -1
            if handler is not None and signal.getsignal(signal.SIGINT) is handler:
                signal.signal(signal.SIGINT, handler.previous)  # type: ignore[attr-defined]


def _noting_handler(previous: object) -> Optional[Callable[[int, Optional[FrameType]], None]]:
    """A SIGINT handler that tells the hook where the cell is, then does what ``previous``
    does (raise KeyboardInterrupt); None when ``previous`` is not a Python handler (the
    signal is ignored or fatal: not ours to change)."""
    if not callable(previous):
        return None

    def handler(signum: int, frame: Optional[FrameType]) -> None:
        _before_interrupt(frame)
        previous(signum, frame)

    handler.previous = previous  # type: ignore[attr-defined]
    return handler


def request() -> None:
    """Ask the watcher to cut the running cell loose (for engines that interrupt by thread)."""
    try:
        os.write(_get().write_fd, _REQUEST)
    except BlockingIOError:  # the pipe is full of earlier requests: one is enough
        pass


# ----------------------------------------------------------------------------- calls by thread
_calls_lock = threading.Lock()
_running: dict[int, str] = {}  # thread ident -> tag of the backend whose call it runs


def register_call(tag: str) -> int:
    """Mark the current thread as running a call of ``tag``; return its ident for
    :func:`forget_call`, which must follow in a ``finally``."""
    ident = threading.get_ident()
    with _calls_lock:
        _running[ident] = tag
    return ident


class _Drained(BaseException):
    """Stands in for a late interrupt, and lands at once (see :func:`forget_call`)."""


def forget_call(ident: int) -> None:
    """Unregister ``ident``, the calling thread, and drop an interrupt that arrived after the
    call had finished.

    A late interrupt is replaced by an exception of ours that is raised and caught here at
    once. Clearing it instead (``PyThreadState_SetAsyncExc`` with NULL) would leave CPython's
    "asynchronous exception pending" flag up for good, since only an exception delivered takes
    it down; while it is up, a traced call (pdb, a coverage tool) spins forever on the
    interpreter's pending-work check at the call's first instruction (CPython 3.11).
    """
    assert ident == threading.get_ident(), "forget_call runs in the thread it registered"
    while True:
        try:
            with _calls_lock:
                _running.pop(ident, None)
                # Interrupts are only raised while registered, under this lock: replace a late
                # one with ours, which the loop below takes at its first check.
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                                           ctypes.py_object(_Drained))
            while True:
                pass
        except _Drained:
            return
        except KeyboardInterrupt:
            continue


def interrupt_calls(tag: str) -> int:
    """Raise KeyboardInterrupt in the threads running calls of ``tag``; return how many.

    Runs beside the busy thread (on Dask, on the worker's event loop via ``Client.run``). A
    thread blocked inside one native call (a long ``time.sleep``) sees it when that call
    returns; one blocked in a collective is cut loose by the watcher after :data:`GRACE`.
    """
    hit = 0
    with _calls_lock:
        busy = tag in _running.values()
    if busy:
        _before_interrupt()  # the cell's thread is still where it stood
    with _calls_lock:
        for ident, t in _running.items():
            if t == tag:
                hit += ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(ident), ctypes.py_object(KeyboardInterrupt))
    if hit:
        request()
    return hit
