"""The data channel over TLS, with real sockets on loopback: a push's fetch and a pull's
delivery (streamed and as a shared copy) arrive whole and are served as TLS; a wrong ticket, a
plain-TCP client and a worker that does not see the pinned certificate are refused, the last
with an error that names the host and what to check, in seconds rather than a hang. On a
plain cluster the channel stays plain TCP, and it follows the engine when that changes."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from nbdist.backends.base import TlsIdentity
from nbdist.group.channel_tls import server_tls
from nbdist.group.transfer import DataChannel, Transfers
from nbdist.runtime import packing
from nbdist.runtime.packing import ChannelTlsError

pytestmark = pytest.mark.timeout(60)

DATA = [np.arange(3 << 20, dtype=np.uint8) * 7, np.arange(1000, dtype=np.uint8)]


@pytest.fixture(scope="module")
def tls():
    return server_tls(TlsIdentity())


@pytest.fixture
def channel(tls):
    ch = DataChannel("127.0.0.1", tls)
    yield ch
    ch.close()


def same(got, want) -> bool:
    return [bytes(memoryview(g).cast("B")) for g in got] == [w.tobytes() for w in want]


def test_a_push_is_fetched_over_tls(channel):
    ticket = channel.offer(DATA)
    assert same(packing.fetch(channel.address, ticket, 10, channel.fingerprint), DATA)
    assert channel.served == {"TLSv1.3": 1}


@pytest.mark.parametrize("shared", [False, True], ids=["streamed", "shared-copy-offer"])
def test_a_pull_is_delivered_over_tls(channel, shared):
    ticket = channel.expect()
    packing.deliver(channel.address, ticket, DATA, 10, shared, channel.fingerprint)
    assert same(channel.take(ticket, 10), DATA)
    assert channel.served == {"TLSv1.3": 1}  # the shared copy's offer too: one connection


def test_a_wrong_ticket_is_closed_unanswered(channel):
    channel.offer(DATA)
    with pytest.raises(ValueError, match="closed after 0 of 4 bytes"):
        packing.fetch(channel.address, secrets.token_bytes(packing.TICKET), 10,
                      channel.fingerprint)
    assert channel.served == {}


def test_a_plain_tcp_client_is_refused_by_a_tls_channel(channel):
    ticket = channel.offer(DATA)
    with pytest.raises((ValueError, OSError)):  # closed (or reset) unanswered
        packing.fetch(channel.address, ticket, 10)
    with socket.create_connection(channel.address, timeout=10) as conn:
        conn.sendall(packing.GET + ticket)  # the live ticket, in the clear
        try:
            assert conn.recv(1) == b""
        except ConnectionResetError:
            pass
    assert channel.served == {}
    # the ticket itself was never spent: the worker that holds it still fetches under TLS
    assert same(packing.fetch(channel.address, ticket, 10, channel.fingerprint), DATA)


def test_a_worker_that_does_not_see_the_pinned_certificate_is_told_why(channel, tls):
    ticket = channel.offer(DATA)
    other = server_tls(TlsIdentity())  # what an impostor at the same address would present
    assert other.fingerprint != tls.fingerprint
    with pytest.raises(ChannelTlsError) as err:
        packing.fetch(channel.address, ticket, 10, other.fingerprint)
    text = str(err.value)
    host, port = channel.address
    assert text.startswith(
        f"worker host {socket.gethostname()} could not open TLS to the notebook's data channel "
        f"at {host}:{port}: it presented a certificate other than the notebook's (SHA-256 "
        f"{tls.fingerprint.hex()[:16]}..., expected {other.fingerprint.hex()[:16]}...)")
    assert f"reaches {host}:{port} directly" in text
    assert channel.served == {}


def test_tls_to_a_plain_listener_fails_at_once_with_the_clear_error():
    plain = DataChannel("127.0.0.1")
    try:
        t0 = time.monotonic()
        with pytest.raises(ChannelTlsError, match=r"could not open TLS to the notebook's data "
                           rf"channel at 127\.0\.0\.1:{plain.address[1]}: "):
            packing.deliver(plain.address, plain.expect(), DATA, 10, False,
                            secrets.token_bytes(32))
        assert time.monotonic() - t0 < 5
    finally:
        plain.close()


def test_a_listener_that_never_answers_the_handshake_ends_in_the_timeout():
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the backlog) and says nothing
    try:
        t0 = time.monotonic()
        with pytest.raises(ChannelTlsError, match="no answer to the handshake within 1 s"):
            packing.fetch(silent.getsockname()[:2], secrets.token_bytes(16), 1,
                          secrets.token_bytes(32))
        assert time.monotonic() - t0 < 5
    finally:
        silent.close()


def test_a_client_that_stalls_in_the_handshake_does_not_hold_the_channel(channel, monkeypatch):
    monkeypatch.setattr(packing, "HANDSHAKE_TIMEOUT", 0.5)
    stalled = socket.create_connection(channel.address, timeout=10)  # connects, sends nothing
    try:
        ticket = channel.offer(DATA)  # others are served meanwhile
        assert same(packing.fetch(channel.address, ticket, 10, channel.fingerprint), DATA)
        assert stalled.recv(1) == b""  # and the stalled one is let go
    finally:
        stalled.close()


class Engine:
    """A backend as Transfers sees it: TLS or not."""

    def __init__(self, identity):
        self.identity = identity

    def channel_tls(self):
        return self.identity


def membership(identity) -> SimpleNamespace:
    return SimpleNamespace(master="127.0.0.1", store=object(), backend=Engine(identity))


def test_the_channel_is_plain_on_a_plain_cluster_and_tls_on_a_tls_one():
    t = Transfers()
    try:
        m = membership(None)
        plain = t.channel(m)
        assert plain.tls is None and plain.fingerprint is None
        assert t.channel(m) is plain  # kept while nothing changes
        m.backend.identity = TlsIdentity()  # connected to a cluster over TLS
        secure = t.channel(m)
        assert secure is not plain and secure.fingerprint is not None
        assert secure.tls.origin == "ephemeral"
        m.backend.identity = None
        assert t.channel(m).tls is None
    finally:
        t.close()


def test_without_a_certificate_to_present_tls_clusters_get_no_channel(monkeypatch):
    """No ``cryptography`` and no client certificate: the values travel in the engine's own
    (encrypted) messages rather than on a plain channel."""
    from nbdist.group import channel_tls

    monkeypatch.setattr(channel_tls, "ephemeral_pem", lambda: None)
    t = Transfers()
    try:
        assert t.channel(membership(TlsIdentity())) is None
    finally:
        t.close()


def test_push_and_pull_hand_the_fingerprint_over_with_the_ticket(monkeypatch):
    """What the workers are called with: the push's ``source`` and the pull's ``sink`` carry
    the channel's fingerprint; a worker that uses it gets the bytes over TLS."""
    t = Transfers()
    t.shared = False  # as with a worker on another machine
    got = {}

    class Calls(SimpleNamespace):
        def call(self, calls, timeout, what):
            [c] = calls
            if c.kwargs.get("source") is not None:
                address, ticket, spec, tls = c.kwargs["source"]
                got["push"] = (packing.fetch(address, ticket, 10, tls), tls)
                return [None]
            address, ticket, shared, tls = c.kwargs["sink"]
            packing.deliver(address, ticket, DATA, 10, shared, tls)
            got["pull"] = tls
            return [[{"ok": True, "channel": True}, header, None]]

    header = packing.pack({"x": 1}).header
    m = Calls(master="127.0.0.1", store=object(), backend=Engine(TlsIdentity()),
              plans={0: SimpleNamespace(worker_id="w")},
              options=SimpleNamespace(timeout=10))
    try:
        t.push(m, {"x": np.arange(2 << 20, dtype=np.uint8)}, [0])
        buffers, fingerprint = got["push"]
        channel = t.channel(m)
        assert fingerprint == channel.fingerprint is not None
        assert same(buffers, [np.arange(2 << 20, dtype=np.uint8)])
        assert t.pull(m, "x", 0) == {"x": 1} and got["pull"] == channel.fingerprint
        assert channel.served == {"TLSv1.3": 2}
    finally:
        t.close()


def test_transfers_run_side_by_side_under_tls(channel):
    tickets = [channel.offer(DATA) for _ in range(4)]
    results: list = [None] * 4

    def one(i):
        results[i] = packing.fetch(channel.address, tickets[i], 10, channel.fingerprint)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert all(r is not None and same(r, DATA) for r in results)
    assert channel.served == {"TLSv1.3": 4}
