"""Interrupts that reach a rank blocked inside a collective.

Python runs a signal handler, or an asynchronous exception, only between bytecodes, so a rank
blocked in a gloo or NCCL wait would ignore an interrupt until the collective's own timeout
(minutes). A watcher thread notices the interrupt instead — through the signal wakeup fd when
the cell runs in the main thread (ipyparallel's SIGINT), or through :func:`request` (Dask's
interrupt) — and, if the cell is still running after a short grace, cuts this rank's
connections to its peers: the collective fails at once and the interrupt lands.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable, Optional

# How long an interrupted cell may take to stop by itself before its connections are cut.
GRACE = 1.0
_REQUEST = b"!"


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
    if in_main:
        previous = signal.set_wakeup_fd(w.write_fd, warn_on_full_buffer=False)
        w.forward_fd = previous
    w.idle.clear()
    try:
        yield w
    finally:
        w.idle.set()
        if in_main:
            signal.set_wakeup_fd(previous, warn_on_full_buffer=False)
            w.forward_fd = -1


def request() -> None:
    """Ask the watcher to cut the running cell loose (for engines that interrupt by thread)."""
    try:
        os.write(_get().write_fd, _REQUEST)
    except BlockingIOError:  # the pipe is full of earlier requests: one is enough
        pass
