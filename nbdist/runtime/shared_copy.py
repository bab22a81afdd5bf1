"""Large buffers as one shared copy in memory, between processes on one machine.

Over the data channel each rank receives its own stream into its own new memory: pushing a
256 MB tensor to 2 local ranks moves 512 MB through loopback and faults in 512 MB of fresh
pages on the receiving side. Here the sender writes the buffers once into an anonymous
memory file (``memfd_create``) and each receiver on the same machine maps that file
copy-on-write (``MAP_PRIVATE``): reading shares the sender's pages, and a receiver that
writes to its tensor gets its own copy of just the pages it writes, so each still holds a
value of its own. The file has no name: it is freed with the last mapping, even when the
sender dies. A push is written by the notebook and mapped by every local rank; a pull is
written by the rank and mapped by the notebook.

A receiver reaches the file as ``/proc/<sender pid>/fd/<fd>``, which the kernel opens only
for the sender's own user; the file's first bytes are the transfer's ticket, so a process on
another machine (or in another PID namespace) that finds some other file there sees no
match, and the bytes go over the data channel instead. Linux only; stdlib only.
"""

from __future__ import annotations

import hmac
import mmap
import os
import stat
import struct
from collections.abc import Sequence
from typing import Any, Optional

#: ``(pid, fd, offsets, sizes, total)``: where the other side finds a shared copy
Spec = tuple[int, int, list[int], list[int], int]
_HEAD = struct.Struct("<QQQQ")  # pid, fd, total, count; then the offsets and sizes
HEAD_SIZE = _HEAD.size


class SharedCopy:
    """The sender's side: the buffers written once after a page that holds ``ticket``;
    :attr:`spec` travels to the receivers, :meth:`close` once every one has mapped it."""

    def __init__(self, buffers: Sequence[Any], ticket: bytes) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        offsets, at = [], mmap.PAGESIZE  # page 0: the ticket; mmap offsets are page-aligned
        for v in views:
            offsets.append(at)
            at += -(-v.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self._fd = os.memfd_create("nbdist-transfer")  # close-on-exec: no child inherits it
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


def encode(spec: Spec) -> bytes:
    """``spec`` as bytes for a socket (read back with :func:`decode`: no pickle)."""
    pid, fd, offsets, sizes, total = spec
    return _HEAD.pack(pid, fd, total, len(offsets)) + struct.pack(
        f"<{2 * len(offsets)}Q", *offsets, *sizes)


def decode(head: bytes, rest: bytes) -> Spec:
    """The spec from :func:`encode`'s first :data:`HEAD_SIZE` bytes and the rest."""
    pid, fd, total, count = _HEAD.unpack(head)
    both = struct.unpack(f"<{2 * count}Q", rest)
    return pid, fd, list(both[:count]), list(both[count:]), total


def rest_size(head: bytes) -> int:
    """How many bytes follow :func:`encode`'s head."""
    return 16 * _HEAD.unpack(head)[3]


def attach(spec: Spec, ticket: bytes) -> Optional[list[memoryview]]:
    """The buffers of the other side's shared copy, mapped copy-on-write (writable: a
    rank's writes stay its own); None where this process cannot reach that copy."""
    pid, fd, offsets, sizes, total = spec
    try:
        # non-blocking: what that fd is here may be a pipe, whose open would wait
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:  # another machine, another user or PID namespace
        return None
    try:
        st = os.fstat(f)
        if not stat.S_ISREG(st.st_mode) or st.st_size != total:
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
