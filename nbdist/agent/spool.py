"""How a rank hands its frames to its node's forwarder: append-only spool files, no socket.

Each rank process writes the frames of :mod:`.wire` to files ``<pid>.<n>`` in the forwarder's
directory (mode 0700), each frame with one ``write`` on the sending thread, never the training
thread. A segment holds about :data:`SEGMENT` bytes; the forwarder deletes a segment once it
has read it and the next one exists. A rank whose forwarder lags :data:`MAX_SEGMENTS`
segments behind drops its batches and counts them (the job never waits for the notebook);
frames that say who a rank is and how it ended are always written.

A spool directory outlives a forwarder that was killed (its exit never ran): each forwarder
writes its process into the directory it owns (:func:`claim`), and every new one removes the
directories of the temporary directory whose forwarder and writers are all gone
(:func:`sweep`).

A rank's end whose exit status only the process's end tells (its script returned, or raised
``SystemExit`` itself: Python gives neither to ``atexit``) is written aside, ``<pid>.exit``,
and the C library writes the status the process exits with, one byte, to ``<pid>.status``
(:meth:`SpoolWriter.record_exit_status`); the reader hands the end on once the process has
ended, failed if that status is not 0.

Commands go the other way as files too: the forwarder writes the notebook's request
(``cmd-stacks-<id>``, whole or not at all), each rank looks for new ones a few times a second
on a thread of its own and answers through its spool.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

from . import wire

#: bytes of one spool segment before the next is started
SEGMENT = 4 << 20
#: segments a rank may be ahead of its forwarder before it drops batches
MAX_SEGMENTS = 4
#: a command file's name starts so; seconds it is kept for the ranks to see it
COMMAND_PREFIX = "cmd-"
COMMAND_TTL = 30.0


#: what follows a rank's pid in the name of its end written aside, and of its exit status
END, STATUS = "exit", "status"
#: seconds a rank's end written aside waits for its process to end before it is read as said
#: (a process that hangs after its Python ended)
SETTLE = 5.0

#: a spool directory's name starts so; the file in it that names its forwarder's process
DIR_PREFIX = "nbdist-attach-"
OWNER = "owner"


def _start_time(pid: int) -> Optional[str]:
    """When process ``pid`` started (clock ticks since boot; None: unknown), which tells it
    from a later process given the same pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == b"Z" else fields[19].decode()


def running(pid: int, started: Optional[str] = None) -> bool:
    """Whether process ``pid`` runs (not a zombie), and is the one started at ``started``
    (its start time in clock ticks, as /proc gives it; None: any)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _start_time(pid)
    if now is None:  # a zombie, or no /proc: a zombie has ended; without /proc, say alive
        return not os.path.exists(f"/proc/{pid}")
    return started is None or now == started


def claim(directory: str) -> None:
    """Write this process into ``directory`` as the one that forwards from it (and removes
    it at its exit)."""
    path = os.path.join(directory, OWNER)
    with open(path + ".tmp", "w", encoding="ascii") as f:
        f.write(f"{os.getpid()} {_start_time(os.getpid()) or ''}\n")
    os.replace(path + ".tmp", path)


#: seconds after which a spool directory that names no forwarder (its launcher was killed
#: between making it and claiming it, or an older nbdist made it) is another's no longer
UNCLAIMED_AFTER = 3600.0


def sweep(parent: str) -> list[str]:
    """Remove the spool directories in ``parent`` that this user's killed forwarders left:
    those whose forwarder process is gone and none of whose rank processes still writes, and
    those that name no forwarder, untouched for :data:`UNCLAIMED_AFTER` seconds, with no
    rank process writing. Returns the directories removed; one that cannot be read is left
    alone."""
    import shutil

    removed = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith(DIR_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
            if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
                continue
            try:
                with open(os.path.join(path, OWNER), encoding="ascii") as f:
                    pid, _, started = f.read().strip().partition(" ")
            except FileNotFoundError:  # unclaimed: a launcher may be about to claim it
                if time.time() - st.st_mtime < UNCLAIMED_AFTER:
                    continue
            else:
                if running(int(pid), started or None):
                    continue
            writers = {int(n.partition(".")[0]) for n in os.listdir(path)
                       if n.partition(".")[0].isdigit()}
            if any(running(w) for w in writers):
                continue
        except (OSError, ValueError):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def write_command(directory: str, msg: dict[str, Any]) -> str:
    """Put the notebook's command ``msg`` (its ``type`` and ``id``) where the ranks of
    ``directory`` look for it: written aside, then renamed."""
    path = os.path.join(directory, f"{COMMAND_PREFIX}{msg['type']}-{int(msg['id'])}")
    with open(path + ".tmp", "wb") as f:
        f.write(wire.encode(msg))
    os.replace(path + ".tmp", path)
    return path


def read_commands(directory: str, seen: set[str]) -> list[dict[str, Any]]:
    """The commands in ``directory`` not in ``seen`` (their names, updated)."""
    out = []
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in sorted(names):
        if not name.startswith(COMMAND_PREFIX) or name.endswith(".tmp") or name in seen:
            continue
        seen.add(name)
        try:
            with open(os.path.join(directory, name), "rb") as f:
                out.append(wire.decode(f.read()[4:]))
        except (OSError, ValueError):
            continue
    return out


class SpoolWriter:
    """One rank's side: frames appended to ``directory``'s files for this process."""

    def __init__(self, directory: str, pid: Optional[int] = None,
                 segment: int = SEGMENT, max_segments: int = MAX_SEGMENTS):
        self.directory = directory
        self.pid = os.getpid() if pid is None else pid
        self.segment = segment
        self.max_segments = max_segments
        self.dropped = 0  # frames dropped because the forwarder lagged
        self._n = 0
        self._size = 0
        self._fd: Optional[int] = None
        self._lock = threading.Lock()

    def _path(self, n: int) -> str:
        return os.path.join(self.directory, f"{self.pid}.{n}")

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self._path(self._n), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                               0o600)
        return self._fd

    def write(self, frame: bytes, droppable: bool = True) -> bool:
        """Append ``frame``; False if it was dropped (counted in :attr:`dropped`)."""
        with self._lock:
            if self._size >= self.segment:
                behind = self._n + 1 - self.max_segments
                if droppable and behind >= 0 and os.path.exists(self._path(behind)):
                    self.dropped += 1
                    return False
                if self._fd is not None:
                    os.close(self._fd)
                self._fd, self._n, self._size = None, self._n + 1, 0
            try:
                os.write(self._open(), frame)
            except OSError:  # the forwarder's directory is gone: the job goes on unreported
                self.dropped += 1
                return False
            self._size += len(frame)
            return True

    def record_exit_status(self) -> bool:
        """Have the C library write this process's exit status, one byte, to
        ``<pid>.status`` when it exits: the status Python exits with, which no Python code
        sees (glibc's ``on_exit`` calls ``fputc(status, file)`` after Python has ended).
        False where the C library has no ``on_exit`` (not glibc) or the file cannot be made.

        A child this process forks writes its own status elsewhere (``/dev/null``)."""
        import ctypes

        try:
            libc = ctypes.CDLL(None)
            on_exit, fopen = libc.on_exit, libc.fopen
        except (OSError, AttributeError):
            return False
        fopen.restype, fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
        fp = fopen(os.fsencode(self._side(STATUS)), b"we")  # e: closed across exec
        if not fp:
            return False
        libc.setvbuf.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        libc.setvbuf(fp, None, 2, 0)  # _IONBF: the byte is written when fputc is called
        on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        # fputc(int c, FILE *f) is the handler on_exit wants, void (*)(int status, void *arg)
        if on_exit(ctypes.cast(libc.fputc, ctypes.c_void_p).value, fp) != 0:
            return False
        freopen = libc.freopen
        freopen.restype = ctypes.c_void_p
        freopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p]
        os.register_at_fork(after_in_child=lambda: freopen(os.devnull.encode(), b"w", fp))
        return True

    def end_aside(self, frame: bytes) -> None:
        """Write the rank's exit ``frame`` aside, to be read once the process has ended with
        the status :meth:`record_exit_status` records (whole or not at all)."""
        path = self._side(END)
        try:
            with open(path + ".tmp", "wb") as f:
                f.write(frame)
            os.replace(path + ".tmp", path)
        except OSError:  # the forwarder's directory is gone: the job goes on unreported
            self.dropped += 1

    def _side(self, what: str) -> str:
        return os.path.join(self.directory, f"{self.pid}.{what}")

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class SpoolReader:
    """The forwarder's side: the frames every rank process appended to ``directory``."""

    def __init__(self, directory: str):
        self.directory = directory
        self._at: dict[int, tuple[int, int]] = {}  # pid -> (segment, offset)
        self._partial: dict[int, bytearray] = {}

    def pids(self) -> list[int]:
        """The rank processes that wrote here, in the order of their pids."""
        found = set(self._at)
        for name in os.listdir(self.directory):
            pid, dot, n = name.partition(".")
            if dot and pid.isdigit() and n.isdigit():
                found.add(int(pid))
        return sorted(found)

    def read(self) -> list[tuple[int, bytes]]:
        """The complete frames (as sent, length included) appended since the last call, with
        the pid of the process that wrote each; segments read to their end are deleted."""
        out: list[tuple[int, bytes]] = []
        for pid in self.pids():
            seg, offset = self._at.get(pid, (self._first(pid), 0))
            buf = self._partial.setdefault(pid, bytearray())
            while True:
                path = os.path.join(self.directory, f"{pid}.{seg}")
                nxt = os.path.join(self.directory, f"{pid}.{seg + 1}")
                done = os.path.exists(nxt)  # looked at before reading: the writer left seg
                try:
                    with open(path, "rb") as f:
                        f.seek(offset)
                        data = f.read()
                except FileNotFoundError:
                    data = b""
                offset += len(data)
                buf += data
                for body in wire.split(buf):
                    out.append((pid, wire.framed(body)))
                if not done:
                    break
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
                seg, offset = seg + 1, 0
            self._at[pid] = (seg, offset)
            end = self._end(pid)
            if end is not None:
                out.append((pid, end))
        return out

    def _end(self, pid: int) -> Optional[bytes]:
        """The exit frame rank ``pid`` wrote aside, once its process has ended (or ran on
        :data:`SETTLE` seconds after it, or is this process, which cannot wait for its own
        end): failed with the status it exited with, if not 0. None: none, or not yet."""
        path = os.path.join(self.directory, f"{pid}.{END}")
        status_path = os.path.join(self.directory, f"{pid}.{STATUS}")
        try:
            with open(path, "rb") as f:
                frame = f.read()
            waited = time.time() - os.stat(path).st_mtime
        except FileNotFoundError:
            return None
        if pid != os.getpid() and waited < SETTLE and running(pid):
            return None
        try:
            with open(status_path, "rb") as f:
                status = f.read(1)
        except FileNotFoundError:
            status = b""
        if status and status != b"\0":
            try:
                msg = wire.decode(frame[4:])
            except ValueError:
                msg = None
            if msg is not None and msg.get("ok"):
                # failed when its script ended (its Python's exit comes later: a peer may
                # fail in between, of the group this process's exit closed)
                msg.update(ok=False, error=f"exited with status {status[0]}",
                           failed_at=msg.get("t") or time.time())
                frame = wire.encode(msg)
        for done in (path, status_path):
            try:
                os.remove(done)
            except FileNotFoundError:
                pass
        return frame

    def _first(self, pid: int) -> int:
        segs = [int(name.partition(".")[2]) for name in os.listdir(self.directory)
                if name.startswith(f"{pid}.") and name.partition(".")[2].isdigit()]
        return min(segs, default=0)
