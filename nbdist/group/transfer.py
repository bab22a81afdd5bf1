"""Push and pull, the notebook's half: values packed as zero-copy buffers
(:mod:`nbdist.runtime.packing`), and a data channel that carries the large ones straight
between a worker and the notebook.

An engine's messages go worker → controller (or scheduler) → notebook: every byte of a
256 MB tensor would cross loopback twice and pass through three processes. Here the call
still goes through the engine (it carries the packed value's small pickle and a ticket), and
for the buffers themselves the worker connects to the notebook's :class:`DataChannel`: it
sends them from the tensors' own memory (:func:`~nbdist.runtime.packing.deliver`), or
receives a push's into memory of its own (:func:`~nbdist.runtime.packing.fetch`), as fast
as one socket carries them. With workers on the notebook's machine the buffers are written
once into a shared copy the other side maps instead (:mod:`nbdist.runtime.shared_copy`: a
push's by the notebook, offered as the call's ``source``; a pull's by the rank, offered over
the channel), falling back to the stream where it cannot be mapped. Small values, and
workers that cannot reach the notebook, use the engine's own messages (each buffer still a
frame of its own, not a copy in a pickle).

Each transfer has its own random 16-byte ticket, handed to the worker over the engine's
authenticated channel; a connection without a live ticket is closed unanswered. The channel
listens where the workers reach the notebook's rendezvous store (loopback for a cluster on
this machine), and goes with the session's cluster. Where the engine reaches the cluster over
TLS (Dask's ``tls://``), the channel speaks TLS too, with a certificate the workers pin
(:mod:`.channel_tls`; its fingerprint travels with the ticket); elsewhere it is plain TCP.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import ssl
import struct
import threading
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

from ..backends.base import Call
from ..runtime import packing, results, shared_copy
from ..runtime import worker as rt
from ..runtime.env import LOOPBACK
from ..runtime.packing import GET, PUT, SHARE, TICKET, receive_buffers, recv_exactly, send_buffers
from ..runtime.shared_copy import SharedCopy
from .channel_tls import ChannelTls, server_tls

if TYPE_CHECKING:
    from .membership import Membership


class DataChannel:
    """A listener on ``host`` serving tickets: buffers to hand out (push) or to take in
    (pull), over TLS with ``tls`` (else plain TCP). Thread per connection:
    ``sendall``/``recv_into`` release the GIL."""

    def __init__(self, host: str, tls: Optional[ChannelTls] = None) -> None:
        self._sock = socket.create_server((host, 0))
        self.address = (host, self._sock.getsockname()[1])
        self.tls = tls
        #: the SHA-256 of the certificate workers must see (handed over with each ticket);
        #: None on plain TCP
        self.fingerprint = tls.fingerprint if tls is not None else None
        #: connections served with a live ticket, by protocol ("tcp", "TLSv1.3", ...)
        self.served: Counter[str] = Counter()
        self._lock = threading.Condition()
        self._out: dict[bytes, Sequence[Any]] = {}  # ticket -> buffers workers fetch
        self._in: dict[bytes, Optional[list[Any]]] = {}  # ticket -> what came
        self._closed = False
        threading.Thread(target=self._accept, name="nbdist-data-channel", daemon=True).start()

    # ------------------------------------------------------------------ the session's side
    def offer(self, buffers: Sequence[Any]) -> bytes:
        """A ticket with which workers fetch ``buffers`` (any number of times, until
        :meth:`forget`)."""
        ticket = secrets.token_bytes(TICKET)
        with self._lock:
            self._out[ticket] = buffers
        return ticket

    def expect(self) -> bytes:
        """A ticket with which one worker delivers buffers; :meth:`take` returns them."""
        ticket = secrets.token_bytes(TICKET)
        with self._lock:
            self._in[ticket] = None
        return ticket

    def take(self, ticket: bytes, timeout: float) -> list[Any]:
        """The buffers delivered with ``ticket`` (waiting up to ``timeout`` s for the rest
        of them: the worker's call returns once it has sent them all)."""
        with self._lock:
            if not self._lock.wait_for(lambda: self._in.get(ticket) is not None, timeout):
                raise TimeoutError(f"the worker's data did not arrive within {timeout:g} s")
            got = self._in.pop(ticket)
        assert got is not None
        return got

    def forget(self, ticket: bytes) -> None:
        with self._lock:
            self._out.pop(ticket, None)
            self._in.pop(ticket, None)

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    # ------------------------------------------------------------------ serving workers
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _known(self, table: dict[bytes, Any], ticket: bytes) -> Optional[bytes]:
        return next((t for t in table if hmac.compare_digest(t, ticket)), None)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                if self.tls is not None:  # a peer that never completes it frees the thread
                    conn.settimeout(packing.HANDSHAKE_TIMEOUT)
                    conn = self.tls.context.wrap_socket(conn, server_side=True)
                    conn.settimeout(None)
                head = recv_exactly(conn, 1 + TICKET)
                op, ticket = head[:1], head[1:]
                with self._lock:
                    out = self._known(self._out, ticket) if op == GET else None
                    into = self._known(self._in, ticket) if op in (PUT, SHARE) else None
                    buffers = self._out[out] if out is not None else None
                    if out is not None or into is not None:
                        self.served[conn.version() if isinstance(conn, ssl.SSLSocket)
                                    else "tcp"] += 1
                if buffers is not None:
                    send_buffers(conn, buffers)
                elif into is not None and op == SHARE:  # a worker on this machine
                    head = recv_exactly(conn, shared_copy.HEAD_SIZE)
                    spec = shared_copy.decode(head, recv_exactly(
                        conn, shared_copy.rest_size(head)))
                    views = shared_copy.attach(spec, into)
                    if views is not None:
                        self._arrived(into, views)
                    conn.sendall(b"k" if views is not None else b"n")  # n: send the bytes
                elif into is not None:
                    self._arrived(into, receive_buffers(conn))
                    conn.sendall(b"k")
            except (OSError, ValueError, struct.error):
                return  # the worker's call reports what went wrong on its side
            finally:
                conn.close()  # the TLS wrapper, where there is one (``with`` holds the socket)

    def _arrived(self, ticket: bytes, got: list[Any]) -> None:
        with self._lock:
            if ticket in self._in:
                self._in[ticket] = got
                self._lock.notify_all()


class Transfers:
    """The session's pushes and pulls (one data channel, opened at the first large one)."""

    def __init__(self) -> None:
        self._channel: Optional[DataChannel] = None
        #: move large values to and from workers on this machine as one shared copy
        #: (False: over the data channel's streams, as with workers on other machines)
        self.shared = True

    def channel(self, membership: Membership) -> Optional[DataChannel]:
        """The data channel, on the address every worker reaches the notebook at, under TLS
        where the engine reaches the cluster over TLS (None where there is none: rank 0's
        worker hosts the store, or a TLS cluster without a certificate to present)."""
        host = membership.master if membership.store is not None else None
        identity = membership.backend.channel_tls() if membership.backend else None
        if self._channel is not None and (self._channel.address[0] != host
                                          or (self._channel.tls is None) != (identity is None)):
            self.close()
        if self._channel is None and host is not None:
            tls = server_tls(identity) if identity is not None else None
            if identity is None or tls is not None:  # never plain on a TLS cluster
                self._channel = DataChannel(host, tls)
        return self._channel

    def push(self, membership: Membership, values: dict[str, Any],
             ranks: Sequence[int]) -> packing.Packed:
        """Put ``values`` in the namespace of each of ``ranks``; returns them packed."""
        header, buffers, layout = packed = packing.pack(values)
        channel = (self.channel(membership) if packing.channel_bytes(buffers) >= packing.CHANNEL_MIN
                   else None)
        ticket = channel.offer(buffers) if channel is not None else None
        shared = None
        try:
            if channel is None or ticket is None:
                args, kwargs = (header, layout, *buffers), {}
            else:  # each worker maps the shared copy, or fetches the buffers itself
                if self.shared and channel.address[0] == LOOPBACK:  # every worker is here
                    shared = SharedCopy.make(buffers, ticket)
                spec = shared.spec if shared is not None else None
                args, kwargs = (header, layout), {
                    "source": (channel.address, ticket, spec, channel.fingerprint)}
            plans = membership.plans
            membership.call([Call(plans[r].worker_id, rt.push, args, kwargs) for r in ranks],
                            membership.options.timeout, "push values")
        finally:
            if ticket is not None:
                channel.forget(ticket)
            if shared is not None:  # each worker's mapping keeps what it took
                shared.close()
        return packed

    def pull(self, membership: Membership, name: str, rank: int) -> Any:
        """``name`` from rank ``rank``'s namespace; NameError (with the rank) if it cannot."""
        channel = self.channel(membership)
        ticket = channel.expect() if channel is not None else None
        sink = ((channel.address, ticket, self.shared, channel.fingerprint)
                if ticket is not None else None)
        timeout = membership.options.timeout
        try:
            [[res, *packed]] = membership.call(
                [Call(membership.plans[rank].worker_id, rt.pull, (name,), {"sink": sink})],
                timeout, f"pull {name!r}")
            res: results.PullResult
            if not res["ok"]:
                raise NameError(f"rank {rank}: {res['evalue']}")
            header, layout, *buffers = packed
            if res.get("channel"):
                buffers = channel.take(ticket, timeout)
            return packing.unpack(header, buffers, layout)
        finally:
            if ticket is not None:
                channel.forget(ticket)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
