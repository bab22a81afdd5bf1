"""What a rank writes to its file descriptors 1 and 2, sent as its output; and what is left of
it on disk when the rank dies.

Python's prints reach the notebook through :class:`~.capture.StreamTee`, which replaces
``sys.stdout``; output written to the descriptors themselves (``os.system``, ``subprocess.run``,
``os.write(2, ...)``, C and C++ libraries: gloo, NCCL_DEBUG) bypasses it. While a cell runs,
:class:`FdCapture` points descriptors 1 and 2 at two files this rank owns (0600, in a per-user
directory, named by the pid: :func:`paths`), and a thread reads new bytes every
:data:`POLL_S` seconds and sends them as the rank's ``stream`` events, as prints are sent: the
notebook prefixes them by rank and shows them under the running cell, as ``--quiet``,
``--all-output`` and ``--ranks`` say. A cell's end reads the files once more, synchronously,
so nothing written in the cell arrives after it; a print reads them first too, so a print and
an ``os.system`` of one thread reach the notebook in the order they ran.

Between cells the descriptors are the worker's own again (the engine's log keeps its lines);
child processes a cell started keep the files, and what they write between cells is sent
with the next cell. Where the original descriptor was not a pipe (an engine's log file, a
terminal), every byte read is written there too; a pipe is most likely the notebook kernel's
own captured output, which would show it again, unprefixed.

``faulthandler`` writes its dump of every thread's Python stack to the stderr file on a fatal
signal (SIGABRT from a C++ abort, SIGSEGV, SIGBUS, SIGFPE), so when a rank dies the notebook
reads its last lines there (:func:`~.last_words.read_tail`) and the cell line it was running
(:func:`~.last_words.cell_line`). A file past :data:`ROTATE_BYTES` is replaced by a fresh
one; the previous one is kept (for the tail) until the next replacement. The files are
removed at the worker's normal exit, and by the notebook once it has read a dead rank's
(:func:`~.last_words.remove`).

SIGKILL (the out-of-memory killer's too), SIGTERM and ``os._exit`` run no dump, so a third
file, ``rank-<pid>.line``, says which cell line the rank runs
(:func:`~.last_words.read_line`): the cell start writes it, the reading thread looks at the
cell thread's innermost cell frame at each tick (``sys._current_frames()``: the cell's thread
runs no hook and pays nothing) and writes it when it changed, the cell's end clears it. Such a
line is "last seen": up to :data:`POLL_S` old. ``os._exit`` is wrapped while the capture is
installed, so that the line of the call itself is written before the process ends (it exits
as before).

Stdlib only.
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import faulthandler
import functools
import os
import stat
import sys
import tempfile
import threading
from collections.abc import Callable
from types import FrameType
from typing import Optional

#: seconds between the reading thread's looks at the files (a look at an idle file: one fstat)
POLL_S = 0.05
#: bytes a file grows to before a fresh one replaces it
ROTATE_BYTES = 4 << 20
#: characters held for the next cell, of output written between cells (the latest kept)
HELD_CHARS = 256 << 10
#: bytes read at a time
CHUNK = 1 << 20
#: the two streams: descriptor and the name of its events
STREAMS = ((1, "stdout"), (2, "stderr"))

#: (stream name, text): where the text read goes (a cell's output, held between cells)
Emit = Callable[[str, str], None]


def directory() -> str:
    """This user's directory for the files (made 0700 where missing)."""
    path = os.path.join(tempfile.gettempdir(), f"nbdist-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def paths(pid: int, folder: Optional[str] = None) -> dict[str, str]:
    """The files of process ``pid``: ``{"stdout": ..., "stderr": ..., "line": ...}`` (its
    output, and the record of the cell line it runs)."""
    folder = folder or os.path.join(tempfile.gettempdir(), f"nbdist-{os.getuid()}")
    out = {name: os.path.join(folder, f"rank-{pid}.{name[3:]}") for _, name in STREAMS}
    out["line"] = os.path.join(folder, f"rank-{pid}.line")
    return out


class _Stream:
    """One descriptor's file: where it is read up to, and the descriptor it replaced."""

    def __init__(self, fd: int, name: str, path: str, through: Optional[int]) -> None:
        self.fd, self.name, self.path = fd, name, path
        self.through = through  # the original descriptor (a dup), or None: not written there
        self.write_fd = _open_new(path)
        self.read_fd = os.open(path, os.O_RDONLY)
        self.pos = 0  # bytes read of the file
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def read(self) -> bytes:
        """The bytes written since the last read (one fstat where there are none)."""
        if os.fstat(self.read_fd).st_size <= self.pos:
            return b""
        out = []
        while True:
            chunk = os.read(self.read_fd, CHUNK)
            if not chunk:
                return b"".join(out)
            self.pos += len(chunk)
            out.append(chunk)

    def rotate(self) -> bytes:
        """A fresh file in place of this one, which is kept as ``.old`` (the previous ``.old``
        removed); returns what was left to read of the replaced one."""
        old = self.path + ".old"
        with contextlib.suppress(OSError):
            os.unlink(old)
        os.rename(self.path, old)
        fresh = _open_new(self.path)
        if os.fstat(self.fd).st_ino == os.fstat(self.write_fd).st_ino:
            os.dup2(fresh, self.fd)  # in a cell: writers move to the fresh file at once
        os.close(self.write_fd)
        self.write_fd = fresh
        rest = self.read()  # anything written before the move
        os.close(self.read_fd)
        self.read_fd, self.pos = os.open(self.path, os.O_RDONLY), 0
        return rest

    def close(self) -> None:
        for fd in (self.write_fd, self.read_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        for path in (self.path, self.path + ".old"):
            with contextlib.suppress(OSError):
                os.unlink(path)


def _open_new(path: str) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC,
                 0o600)
    os.set_inheritable(fd, False)
    return fd


def _through(fd: int) -> Optional[int]:
    """A duplicate of ``fd`` to write what is read through to, or None where ``fd`` is a pipe
    (or closed)."""
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        dup = os.dup(fd)
    except OSError:
        return None
    os.set_inheritable(dup, False)
    return dup


class LineRecord:
    """The cell line a thread runs, kept in a small file (``rank-<pid>.line``) for the notebook
    to read once the process is dead (:func:`~.last_words.read_line`).

    :meth:`start` (on the cell's thread) names the thread and the cell's filename; :meth:`look`
    (any other thread) reads that thread's innermost frame of a cell's code (this cell's, or
    a function an earlier cell defined) and writes its line where it changed: one ``pwrite``
    of a few bytes, nothing where it did not. The file holds one line, ``<kind> <line>
    <filename>``: ``seen`` (a look, or the cell's start: line 0) or ``at`` (the line of an
    ``os._exit`` call, :meth:`exiting`).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        # not O_APPEND (as the output files are): each record is written over the last
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self.cell: Optional[tuple[int, str]] = None  # (thread ident, cell filename)
        self.text = b""  # what the file holds now (less its padding)
        self._size = 0  # bytes written at most: a shorter record is padded over the longer
        self._lock = threading.Lock()

    def start(self, filename: str) -> None:
        """A cell named ``filename`` starts on this thread."""
        with self._lock:
            self.cell = (threading.get_ident(), filename)
            self._write_locked(b"seen 0 " + filename.encode())

    def clear(self) -> None:
        """The cell ended: no line is run now."""
        with self._lock:
            self.cell = None
            self._write_locked(b"")

    def look(self) -> None:
        """Write the line the cell's thread runs now, where it changed."""
        cell = self.cell
        if cell is None:
            return
        line, filename = _cell_lineno(sys._current_frames().get(cell[0]))
        if line:
            with self._lock:
                if self.cell == cell:
                    self._write_locked(f"seen {line} {filename}".encode())

    def exiting(self, frame: Optional[FrameType]) -> None:
        """The process ends now (``os._exit`` called at ``frame``): write the cell line of the
        call (the cell thread's line, where another thread calls it)."""
        cell = self.cell
        if cell is None:
            return
        if threading.get_ident() != cell[0]:
            frame = sys._current_frames().get(cell[0])
        line, filename = _cell_lineno(frame)
        if line:
            with self._lock:
                self._write_locked(f"at {line} {filename}".encode())

    def _write_locked(self, text: bytes) -> None:
        if text == self.text:
            return
        with contextlib.suppress(OSError):  # a full disk: the death is still named
            os.pwrite(self.fd, text.ljust(self._size), 0)
            self._size = max(self._size, len(text))
            self.text = text

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _cell_lineno(frame: Optional[FrameType]) -> tuple[int, str]:
    """The line and filename of the innermost frame of ``frame``'s stack that runs a cell's
    code (this cell's, or a function an earlier cell defined: as a dump's line is read);
    ``(0, "")`` where none does."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith("<distributed cell"):
            return frame.f_lineno or 0, filename
        frame = frame.f_back
    return 0, ""


class FdCapture:
    """This process's descriptors 1 and 2, captured while a cell runs (:meth:`begin`,
    :meth:`end`) and read by a daemon thread.

    Parameters
    ----------
    folder
        Where the files are (default: :func:`directory`).
    rotate_bytes
        Bytes a file grows to before it is replaced (default :data:`ROTATE_BYTES`).
    poll_s
        Seconds between the thread's reads (default :data:`POLL_S`; 0: no thread, reads only
        when asked).
    """

    def __init__(self, folder: Optional[str] = None, rotate_bytes: int = ROTATE_BYTES,
                 poll_s: float = POLL_S) -> None:
        self.pid = os.getpid()
        self.rotate_bytes = rotate_bytes
        files = paths(self.pid, folder or directory())
        self.streams = [_Stream(fd, name, files[name], _through(fd)) for fd, name in STREAMS]
        #: the cell line this process runs, for the notebook after a death with no dump
        self.line = LineRecord(files["line"])
        self._saved: list[int] = []  # the worker's own 1 and 2 while a cell has them
        self._emit: Optional[Emit] = None
        self._held: list[tuple[str, str]] = []
        self._held_chars = 0
        self.dropped_chars = 0  # held output dropped for the bound, since the last cell
        self._lock = threading.RLock()
        self._closed = False
        # A fatal signal's dump of every thread's stack, for the notebook to find the cell line
        # (the thread that aborts may be one of gloo's, with no Python frame)
        faulthandler.enable(file=self.streams[1].write_fd, all_threads=True)
        self._thread: Optional[threading.Thread] = None
        if poll_s > 0:
            self._poll_s = poll_s
            self._wake = threading.Event()
            self._thread = threading.Thread(target=self._loop, name="nbdist-fd-output",
                                            daemon=True)
            self._thread.start()

    def begin(self, emit: Emit, filename: Optional[str] = None) -> None:
        """A cell starts: descriptors 1 and 2 write to the files, and what is read goes to
        ``emit`` (output held since the last cell first); where ``filename`` (the cell's code)
        is given, the line record follows this thread in it."""
        _flush_python()
        if filename is not None:
            self.line.start(filename)
        with self._lock:
            self.drain_locked()
            self._emit = emit
            held, self._held, self._held_chars = self._held, [], 0
            if self.dropped_chars:
                emit("stderr", f"[nbdist: {self.dropped_chars:,} characters written between "
                               "cells were not kept]\n")
                self.dropped_chars = 0
            for name, text in held:
                emit(name, text)
            if not self._saved:
                self._saved = [os.dup(fd) for fd, _ in STREAMS]
                for s in self.streams:
                    os.dup2(s.write_fd, s.fd)

    def end(self) -> None:
        """The cell ends: what it wrote is read and sent now, and 1 and 2 are the worker's
        own again."""
        _flush_python()
        with self._lock:
            if self._saved:
                for (fd, _), saved in zip(STREAMS, self._saved):
                    os.dup2(saved, fd)
                    os.close(saved)
                self._saved = []
            self.drain_locked()
            self._emit = None
        self.line.clear()

    def drain(self) -> None:
        """Read what the files hold now and send (or hold) it."""
        with self._lock:
            self.drain_locked()

    def drain_locked(self) -> None:
        for s in self.streams:
            data = s.read()
            if s.through is not None and data:
                with contextlib.suppress(OSError):
                    _write_all(s.through, data)
            text = s.decoder.decode(data) if data else ""
            if text:
                self._send(s.name, text)
            if s.pos >= self.rotate_bytes:
                rest = s.rotate()
                if rest:
                    if s.through is not None:
                        with contextlib.suppress(OSError):
                            _write_all(s.through, rest)
                    self._send(s.name, s.decoder.decode(rest))
                if s.fd == 2:
                    faulthandler.enable(file=s.write_fd, all_threads=True)

    def _send(self, name: str, text: str) -> None:
        if self._emit is not None:
            self._emit(name, text)
            return
        self._held.append((name, text))
        self._held_chars += len(text)
        while self._held_chars > HELD_CHARS and self._held:
            first_name, first = self._held[0]
            cut = min(len(first), self._held_chars - HELD_CHARS)
            self.dropped_chars += cut
            self._held_chars -= cut
            if cut == len(first):
                self._held.pop(0)
            else:
                self._held[0] = (first_name, first[cut:])

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait(self._poll_s)
            if self._closed:
                return
            try:
                self.line.look()
            except Exception:  # where the cell is is a detail of a death; output is not
                pass
            # Non-blocking: a cell's end or a print reading them now is as good
            if self._lock.acquire(blocking=False):
                try:
                    self.drain_locked()
                except Exception as exc:  # say so once, on the worker's own stderr
                    sys.__stderr__.write(f"nbdist: could not read fd output: {exc!r}\n")
                    self._closed = True
                finally:
                    self._lock.release()

    def close(self) -> None:
        """Stop reading, give 1 and 2 back, remove the files (in the process that made them:
        a fork's exit leaves its parent's alone)."""
        if os.getpid() != self.pid or not self.streams:
            return
        self._closed = True
        if self._thread is not None:
            self._wake.set()
            self._thread.join(timeout=1)
        with contextlib.suppress(Exception):
            self.end()
        with contextlib.suppress(Exception):
            faulthandler.disable()
        for s in self.streams:
            if s.through is not None:
                with contextlib.suppress(OSError):
                    os.close(s.through)
            s.close()
        self.streams = []
        self.line.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _flush_python() -> None:
    """Flush Python's own streams on 1 and 2, so their buffered bytes land where they were
    written (before a descriptor moves)."""
    for stream in (sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


_capture: Optional[FdCapture] = None


def install(folder: Optional[str] = None) -> Optional[FdCapture]:
    """This process's capture, made once per process (a fork makes its own: its parent's
    files and thread are not its own); None where descriptors cannot be captured here."""
    global _capture
    if _capture is not None and _capture.pid == os.getpid():
        return _capture
    _capture = None  # a fork's copy of its parent's: not closed, the parent still uses it
    try:
        _capture = FdCapture(folder)
    except OSError as exc:  # no temp directory: Python's prints still reach the notebook
        sys.__stderr__.write(f"nbdist: output written to file descriptors 1 and 2 is not "
                             f"captured on this worker: {exc}\n")
        return None
    atexit.register(_capture.close)
    if not getattr(os._exit, "nbdist_wrapped", False):
        os._exit = _recording_exit(os._exit)
    return _capture


def _recording_exit(real: Callable[[int], None]) -> Callable[[int], None]:
    """``os._exit`` that first writes the cell line of its call (:meth:`LineRecord.exiting`)
    in a process with a capture: no tick of the reading thread may come before it ends."""

    @functools.wraps(real)
    def _exit(status: int) -> None:
        capture = current()
        if capture is not None:
            with contextlib.suppress(Exception):
                capture.line.exiting(sys._getframe(1))
        real(status)

    _exit.nbdist_wrapped = True  # type: ignore[attr-defined]
    return _exit


def current() -> Optional[FdCapture]:
    """This process's capture, None where :func:`install` did not make one here."""
    return _capture if _capture is not None and _capture.pid == os.getpid() else None

