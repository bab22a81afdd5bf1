"""A push's buffers as one shared copy in memory, for the workers on the notebook's machine.

Over the data channel each rank receives its own stream into its own new memory: pushing a
256 MB tensor to 2 local ranks moves 512 MB through loopback and faults in 512 MB of fresh
pages on the receiving side. Here the notebook writes the buffers once into an anonymous
memory file (``memfd_create``) and each worker on the same machine maps that file
copy-on-write (``MAP_PRIVATE``): reading shares the notebook's pages, and a rank that writes
to its tensor gets its own copy of just the pages it writes, so each rank still holds a
value of its own. The file has no name: it is freed with the last mapping, even when the
notebook dies.

A worker reaches the file as ``/proc/<notebook pid>/fd/<fd>``, which the kernel opens only
for the notebook's own user; the file's first bytes are the push's ticket, so a worker on
another machine (or in another PID namespace) that finds some other file there sees no
match and fetches over the data channel instead. Linux only; stdlib only.
"""

from __future__ import annotations

import hmac
import mmap
import os
from collections.abc import Sequence
from typing import Any, Optional

#: ``(pid, fd, offsets, sizes, total)``: where a worker finds a shared copy
Spec = tuple[int, int, list[int], list[int], int]


class SharedCopy:
    """The notebook's side: the buffers written once after a page that holds ``ticket``;
    :attr:`spec` travels to the workers, :meth:`close` once every worker has mapped it."""

    def __init__(self, buffers: Sequence[Any], ticket: bytes) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        offsets, at = [], mmap.PAGESIZE  # page 0: the ticket; mmap offsets are page-aligned
        for v in views:
            offsets.append(at)
            at += -(-v.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self._fd = os.memfd_create("nbdist-push")  # close-on-exec: no child inherits it
        try:
            os.ftruncate(self._fd, at)
            _write(self._fd, memoryview(ticket), 0)
            for v, off in zip(views, offsets):
                _write(self._fd, v, off)
        except BaseException:
            os.close(self._fd)
            raise
        self.spec: Spec = (os.getpid(), self._fd, offsets, [v.nbytes for v in views], at)

    @classmethod
    def make(cls, buffers: Sequence[Any], ticket: bytes) -> Optional[SharedCopy]:
        """A shared copy, or None where the system cannot make one (not Linux, no memory
        for it): the push then goes over the data channel alone."""
        if not hasattr(os, "memfd_create"):
            return None
        try:
            return cls(buffers, ticket)
        except OSError:
            return None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _write(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def attach(spec: Spec, ticket: bytes) -> Optional[list[memoryview]]:
    """The buffers of the notebook's shared copy, mapped copy-on-write (writable: a rank's
    writes stay its own); None where this worker cannot reach that copy."""
    pid, fd, offsets, sizes, total = spec
    try:
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
    except OSError:  # another machine, another user or PID namespace
        return None
    try:
        if os.fstat(f).st_size != total:
            return None
        m = mmap.mmap(f, total, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):
        return None
    finally:
        os.close(f)  # the mapping keeps the file
    if not hmac.compare_digest(m[:len(ticket)], ticket):
        m.close()
        return None
    whole = memoryview(m)  # the slices keep the mapping alive as long as a tensor uses them
    return [whole[off:off + n] for off, n in zip(offsets, sizes)]
