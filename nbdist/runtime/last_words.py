"""What a dead rank left on its host, read by the notebook (or by a Dask nanny there for it):
the last lines it wrote to stderr, the cell line a fatal signal's dump or its line record
names, and the files removed once read.

:mod:`.fd_output` writes the files while the rank lives (``rank-<pid>.out``, ``.err`` and
``.line`` in a per-user directory: :func:`~.fd_output.paths`); this module only reads what is
left of them after the process is gone. Stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from typing import Optional

from .fd_output import paths

#: lines of a dead rank's stderr the notebook shows
TAIL_LINES = 12
#: bytes read from the end of a file for its tail
TAIL_BYTES = 64 << 10


def read_tail(pid: int, folder: Optional[str] = None) -> list[str]:
    """The last lines (no blank ones; those of its last :data:`TAIL_BYTES` bytes) process
    ``pid`` wrote to its stderr file (its previous file's too, where a fresh one replaced
    it); [] where there is none."""
    path = paths(pid, folder)["stderr"]
    data = b""
    for p in (path + ".old", path):
        try:
            with open(p, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
                data = (data + f.read())[-TAIL_BYTES:]
        except OSError:
            continue
    text = data.decode("utf-8", errors="replace")
    return [ln.rstrip() for ln in text.splitlines() if ln.strip()]


def remove(pid: int, folder: Optional[str] = None) -> None:
    """Remove process ``pid``'s files (a dead rank's, once read)."""
    for path in paths(pid, folder).values():
        for p in (path, path + ".old"):
            with contextlib.suppress(OSError):
                os.unlink(p)


def read_line(pid: int, folder: Optional[str] = None) -> Optional[tuple[str, bool]]:
    """The cell line process ``pid``'s record (:class:`LineRecord`) holds, worded as
    :func:`cell_line` words a dump's (``line 4 of In [5]``; ``the start of In [5]`` where no
    look saw a line yet), and whether it is exact (``os._exit``'s call) rather than last
    seen; None where it ran no cell, or has no record."""
    try:
        with open(paths(pid, folder)["line"], "rb") as f:
            text = f.read(4096).decode("utf-8", errors="replace").strip()
    except OSError:
        return None
    kind, _, rest = text.partition(" ")
    number, _, filename = rest.partition(" ")
    if kind not in ("seen", "at") or not number.isdigit() or not _CELL_FILE.match(filename):
        return None
    named = _NUMBERED.fullmatch(filename)
    cell = f"In [{named[1]}]" if named else filename
    words = f"line {number} of {cell}" if int(number) else f"the start of {cell}"
    return words, kind == "at"


def last_words(pid: int, host: Optional[str] = None) -> Optional[dict]:
    """What a dead rank left on this host, read and then removed: what its host (a Dask
    nanny, or another worker there) runs for the notebook. ``{"tail": lines, "line":
    read_line's answer}``; None where ``host`` is given and is not this one, or where
    ``pid`` left nothing here (or still runs)."""
    if host is not None and host != socket.gethostname():
        return None
    if not any(os.path.exists(p) for p in paths(pid).values()) or _alive(pid):
        return None
    try:
        return {"tail": read_tail(pid), "line": read_line(pid)}
    finally:
        remove(pid)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's: it runs
    return True


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+)')
#: the filename of a cell's code (``nbdist.cell.loop.cell_name``)
_CELL_FILE = re.compile(r"<distributed cell")
_NUMBERED = re.compile(r"<distributed cell \[(\d+)\]>")


def cell_line(tail: list[str]) -> Optional[str]:
    """The cell line a rank was running, from a fatal signal's dump of its threads' stacks
    in its stderr ``tail`` (most recent call first): ``line 2 of In [5]`` (``line 2 of
    <distributed cell 3>`` for a cell the kernel did not number), the innermost cell frame of
    the last dump; None where no dump names a cell's line."""
    found = None
    in_stack = first = False
    for ln in tail:
        if "most recent call first" in ln:
            in_stack, first = True, True
            continue
        m = _FRAME.match(ln)
        if m is None:
            in_stack = False
            continue
        if in_stack and first and _CELL_FILE.match(m["file"]):
            number = _NUMBERED.fullmatch(m["file"])
            found = f"line {m['line']} of " + (f"In [{number[1]}]" if number else m["file"])
            first = False
    return found


def told(tail: list[str], lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of ``tail`` a person reads for why the rank died: without
    faulthandler's dump (its stacks say only where, which :func:`cell_line` reads)."""
    out = []
    for ln in tail:
        if ln.startswith(("Fatal Python error:", "Thread 0x", "Current thread 0x",
                          "Extension modules:")) or _FRAME.match(ln) \
                or ln.strip().startswith("<no Python frame>"):
            continue
        out.append(ln)
    return out[-lines:] if lines else []
