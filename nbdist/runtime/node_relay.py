"""A node's ranks in one message: the cell's lowest rank on each host relays its peers' batches.

At sixteen thousand ranks, a rank's batch every 4 s is four thousand messages a second for the
notebook's client to check, parse and unpickle: more than a tenth of a core before any of them
is folded. During a cell, the ranks of one host that run it therefore hand their batches to
the lowest of them (the *relay*), which sends them on with its own as one message: the
notebook's cost per message is paid per host, not per rank.

How: the relay binds a Unix datagram socket in a directory only this user can enter
(:func:`relay_path`); a peer sends it each batch that holds nothing but figures (what only the
run's fold reads: sealed) as one datagram, without blocking (:class:`Peer`); output, prompts
and the hang doctor's reports go straight to the notebook, so a relay that dies takes none of
them along. The relay drains its socket on each tick of its sending thread, and sends what it
holds with its own batch once every peer has sent one since its last message (a host's ranks
flush together as the cell begins, at the same pace:
:func:`~nbdist.telemetry.events.figures_interval`), at once when a peer marked its batch as
one that cannot wait, and at the latest one interval after the oldest it holds arrived.

Nothing waits on the relay. A peer whose datagram cannot go (no relay bound yet, its socket
full, a batch larger than a datagram, the relay gone) sends that batch itself, as it would
without a relay; once the relay is gone, every later one. A rank's batches may then reach
the notebook out of order, which the run's fold puts right by their ``seq``
(:meth:`~nbdist.telemetry.run.Run.feed`). When the relay's call ends it unbinds first (later
datagrams fail, and their peers send themselves), then sends what its socket still held.

Stdlib only; nothing here is imported unless a cell runs on more than one rank of a host.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import socket
import stat
import tempfile
import time
from typing import Any, Optional

#: bytes of batches a relay's socket holds for it between two ticks (the kernel caps it at
#: ``net.core.rmem_max``); a peer whose datagram does not fit sends that batch itself
RECEIVE_BUFFER = 4 << 20
#: bytes of the largest datagram a peer sends (its socket's send buffer caps it, at most
#: ``net.core.wmem_max``); a larger one fails to send, and the peer sends that batch itself
DATAGRAM_MAX = 4 << 20
#: the first byte of a peer's datagram: its batch holds an event that cannot wait
URGENT_MARK, PLAIN_MARK = b"!", b"."

__all__ = ["Peer", "Relay", "host_ranks", "relay_for", "relay_path"]


def host_ranks(rank: int, local_rank: int, local_world_size: int, peers: list[int]
               ) -> list[int]:
    """The ranks among ``peers`` (a cell's) on this rank's host: ranks of a host are numbered
    together, ``rank - local_rank`` onwards (as :func:`~nbdist.runtime.env.plan_ranks`
    numbers them).

    >>> host_ranks(5, 1, 4, [0, 1, 2, 3, 4, 5, 6, 7]), host_ranks(4, 0, 4, [0, 4, 6])
    ([4, 5, 6, 7], [4, 6])
    """
    first = rank - local_rank
    return [r for r in peers if first <= r < first + local_world_size]


def relay_for(here: list[int], rank: int) -> Optional[int]:
    """The rank that relays ``rank``'s batches, ``here`` being the cell's ranks on its host
    (:func:`host_ranks`): the lowest of them. None where no other rank of the host runs the
    cell.

    >>> relay_for([4, 5, 6, 7], 5), relay_for([4, 6], 4), relay_for([4], 4)
    (4, 4, None)
    """
    return min(here) if len(here) > 1 and rank in here else None


def relay_path(cell_id: str, relay: int) -> str:
    """Where the relay of rank ``relay`` binds its socket for the cell ``cell_id``: in a
    directory of this user's only (mode 0700), made if missing.

    Raises
    ------
    OSError
        The directory exists and belongs to another user or others may enter it (no relay is
        made: every rank then sends its own batches).
    """
    folder = os.path.join(tempfile.gettempdir(), f"nbdist-relay-{os.getuid()}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(errno.EPERM, f"{folder} is not this user's own directory")
    # Short (a socket's path has at most 107 bytes), and one per notebook, cell and host
    digest = hashlib.sha1(cell_id.encode()).hexdigest()[:16]
    return os.path.join(folder, f"{digest}-{relay}.sock")


class Relay:
    """The relay's end: holds its peers' batches until they are due (see the module's doc).

    Parameters
    ----------
    path : str
        Where to bind (:func:`relay_path`).
    peers : int
        How many other ranks of the host send to it.
    interval : float
        Seconds between a rank's batches (its sink's): the most a batch is held here.

    Raises
    ------
    OSError
        The socket could not be bound (the caller then relays nothing).
    """

    def __init__(self, path: str, peers: int, interval: float):
        self.path = path
        self.peers = peers
        self.interval = interval
        self._held: list[dict[str, Any]] = []
        self._from: set[int] = set()  # ranks whose batch is held
        self._since: Optional[float] = None  # when the oldest held batch came
        self._urgent = False
        #: batches relayed so far, and datagrams that could not be read as one
        self.relayed = 0
        self.unreadable = 0
        #: where each datagram is read: as large as the largest a peer's socket sends
        self._buf = bytearray(DATAGRAM_MAX)
        self._sock: Optional[socket.socket] = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
            self._sock.setblocking(False)
            _sweep(os.path.dirname(path))
            try:
                os.unlink(path)  # left by a relay of this cell that died (a retried cell)
            except FileNotFoundError:
                pass
            self._sock.bind(path)
        except OSError:
            self._sock.close()
            self._sock = None
            raise

    def collect(self) -> None:
        """Take the datagrams that came since the last look (never blocks)."""
        sock = self._sock
        if sock is None:
            return
        buf = self._buf
        while True:
            try:
                n = sock.recv_into(buf)
            except OSError:  # nothing more now (or the socket is gone)
                return
            try:
                batch = pickle.loads(memoryview(buf)[1:n])
                rank = batch["rank"]
            except Exception:  # not a peer's batch: nothing to relay
                self.unreadable += 1
                continue
            if self._since is None:
                self._since = time.monotonic()
            self._held.append(batch)
            self._from.add(rank)
            self._urgent = self._urgent or buf[:1] == URGENT_MARK

    def due(self) -> bool:
        """Whether what it holds should go now: every peer sent since the last message, a
        batch cannot wait, or the oldest has waited an interval."""
        if not self._held:
            return False
        return (self._urgent or len(self._from) >= self.peers
                or time.monotonic() - (self._since or 0.0) >= self.interval)

    def take(self) -> list[dict[str, Any]]:
        """The batches held, oldest first, handed over to be sent."""
        out, self._held = self._held, []
        self._from.clear()
        self._since, self._urgent = None, False
        self.relayed += len(out)
        return out

    def close(self) -> list[dict[str, Any]]:
        """Stop relaying: unbind (peers' later datagrams fail, so they send themselves), then
        hand over what the socket still held."""
        sock = self._sock
        if sock is None:
            return []
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self.collect()
        self._sock = None
        sock.close()
        return self.take()


#: seconds after which a socket a relay left (it died, and did not unbind) is removed
STALE_S = 86_400.0


def _sweep(folder: str) -> None:
    """Remove the sockets relays that died left in ``folder`` over :data:`STALE_S` ago (a
    relay that lives unbinds its own as its call ends)."""
    now = time.time()
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        path = os.path.join(folder, name)
        try:
            if now - os.lstat(path).st_mtime > STALE_S:
                os.unlink(path)
        except OSError:
            continue


class Peer:
    """A peer's end: hands batches to the relay at ``path`` while it takes them."""

    def __init__(self, path: str):
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        #: True once the relay went away: every later batch is sent by the rank itself
        self.gone = False
        self._reached = False  # a datagram reached the relay once
        #: batches handed over, and those this rank sent itself instead
        self.handed = self.declined = 0

    def send(self, batch: dict[str, Any], urgent: bool = False) -> bool:
        """Hand ``batch`` to the relay; False where the caller must send it itself."""
        if self.gone:
            self.declined += 1
            return False
        data = (URGENT_MARK if urgent else PLAIN_MARK) + pickle.dumps(batch, 5)
        try:
            self._sock.sendto(data, self.path)
        except OSError as exc:
            # No relay yet (it binds as its cell starts), gone after it was there (its call
            # ended, or it died), its socket full, or a batch too large for one datagram
            if self._reached and exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
                self.gone = True
            self.declined += 1
            return False
        self._reached = True
        self.handed += 1
        return True

    def close(self) -> None:
        self._sock.close()
