"""A host's ranks' batches in one message (:mod:`nbdist.runtime.node_relay`): real Unix
datagram sockets between a relay and its peers in this process, and the sinks that use them."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
import threading

import pytest

from nbdist.runtime import node_relay
from nbdist.runtime.capture import EventSink
from nbdist.runtime.node_relay import Peer, Relay, host_ranks, relay_for, relay_path
from nbdist.telemetry import events as ev
from nbdist.telemetry.run import Run


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """Relay sockets under this test's own temporary directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def batch(rank, seq, text="x"):
    return {"rank": rank, "seq": seq, "events": [ev.stream("stdout", text)]}


def test_the_lowest_rank_of_a_host_in_the_cell_relays_for_the_others():
    cell = [0, 1, 2, 3, 5, 6, 7]  # two hosts of four ranks; rank 4 is not in the cell
    assert host_ranks(5, 1, 4, cell) == [5, 6, 7]
    assert [relay_for(host_ranks(r, r % 4, 4, cell), r) for r in cell] == [0, 0, 0, 0, 5, 5, 5]
    assert relay_for(host_ranks(4, 0, 4, cell), 4) is None  # not in the cell
    assert relay_for(host_ranks(4, 0, 4, [0, 4]), 4) is None  # alone on its host


def test_the_socket_lives_in_a_directory_only_its_user_may_enter(private_tmp):
    path = relay_path("cell-1", 0)
    folder = os.path.dirname(path)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert len(path.encode()) < 108 and path != relay_path("cell-2", 0) != relay_path("cell-1", 4)
    os.chmod(folder, 0o755)  # another user could connect: no relay
    with pytest.raises(OSError, match="not this user's own"):
        relay_path("cell-1", 0)


def test_peers_batches_go_with_the_relays_once_every_peer_sent(private_tmp):
    path = relay_path("cell", 0)
    first, second = Peer(path), Peer(path)
    assert not first.send(batch(1, 1)) and not first.gone  # no relay yet: sent itself
    relay = Relay(path, peers=2, interval=3600)
    try:
        assert first.send(batch(1, 2))
        relay.collect()
        assert not relay.due()  # waits for the other peer, within the interval
        assert second.send(batch(2, 7))
        relay.collect()
        assert relay.due()
        assert [(b["rank"], b["seq"]) for b in relay.take()] == [(1, 2), (2, 7)]
        assert not relay.due() and relay.relayed == 2

        assert first.send(batch(1, 3), urgent=True)  # the hang doctor's report: at once
        relay.collect()
        assert relay.due()
        relay.take()
        assert first.send(batch(1, 4))
        relay.interval = 0.0  # the oldest has waited an interval: it goes without the other
        relay.collect()
        assert relay.due()
    finally:
        held = relay.close()
        first.close()
        second.close()
    assert [(b["rank"], b["seq"]) for b in held] == [(1, 4)]  # what it still held, handed over


def test_once_the_relay_unbinds_its_peer_sends_every_batch_itself(private_tmp):
    path = relay_path("cell", 0)
    relay = Relay(path, peers=1, interval=3600)
    peer = Peer(path)
    assert peer.send(batch(1, 1))
    assert [b["seq"] for b in relay.close()] == [1]
    assert not peer.send(batch(1, 2)) and peer.gone
    assert not peer.send(batch(1, 3))
    assert (peer.handed, peer.declined) == (1, 2)
    peer.close()


def test_a_batch_larger_than_a_datagram_is_sent_by_the_rank_itself(private_tmp):
    path = relay_path("cell", 0)
    relay = Relay(path, peers=1, interval=3600)
    peer = Peer(path)
    try:
        limit = peer._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert not peer.send(batch(1, 1, "x" * 2 * limit)) and not peer.gone
        assert peer.send(batch(1, 2))  # the relay is still there for the next
    finally:
        assert [b["seq"] for b in relay.close()] == [2]
        peer.close()


def test_a_datagram_that_is_not_a_batch_is_counted_and_dropped(private_tmp):
    path = relay_path("cell", 0)
    relay = Relay(path, peers=1, interval=3600)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(b"not a pickle", path)
    relay.collect()
    assert relay.unreadable == 1 and not relay.due()
    assert relay.close() == []
    assert not os.path.exists(path)


def sinks(private_tmp):
    """A relay's sink and its peer's (a cell's: sealed), each with its own list of what it
    sent the notebook."""
    sent: dict[int, list] = {0: [], 1: []}
    relay, peer = EventSink(0, sent[0].append, interval=3600, sealed=True), \
        EventSink(1, sent[1].append, interval=3600, sealed=True)
    path = relay_path("cell", 0)
    relay.relay = Relay(path, peers=1, interval=3600)
    peer.peer = Peer(path)
    return relay, peer, sent


def steps(sink, first):
    """Two training steps into ``sink``: a batch of nothing but sealed telemetry."""
    for n in (first, first + 1):
        sink.emit(ev.step(n, float(n), n + 0.5))


def test_a_relays_sink_sends_its_own_batch_and_its_peers_as_one_message(private_tmp):
    relay, peer, sent = sinks(private_tmp)
    try:
        steps(peer, 0)
        assert peer.flush() == 1 and sent[1] == []  # handed to the relay
        relay.emit(ev.stream("stdout", "from 0\n"))
        relay.flush()
        (message,) = sent[0]
        assert [(b["rank"], b["seq"]) for b in message] == [(0, 1), (1, 1)]
        assert [e["kind"] for e in message[1]["events"]] == ["sealed"]
    finally:
        peer.end_relay()
        relay.end_relay()
        peer.close()
        relay.close()
    assert (relay.relayed, peer.handed, peer.declined) == (1, 1, 0)


def test_the_relays_sending_thread_sends_once_every_peer_sent(private_tmp):
    relay, peer, sent = sinks(private_tmp)
    went = threading.Event()
    relay.transport = lambda m: (sent[0].append(m), went.set())
    try:
        steps(peer, 0)
        peer.flush()
        assert went.wait(5)  # its interval is an hour: the peer's batch made it due
        (message,) = sent[0]  # one batch: sent as one
        assert (message["rank"], message["seq"]) == (1, 1)
    finally:
        peer.end_relay()
        relay.end_relay()
        peer.close()
        relay.close()


def test_a_batch_sent_itself_after_one_the_relay_holds_says_so_and_waits_for_it(private_tmp):
    relay, peer, sent = sinks(private_tmp)
    run = Run("cell", [0, 1], world_size=2)
    try:
        steps(peer, 0)
        peer.flush()  # handed to the relay, which holds it
        peer.emit(ev.stream("stdout", "output\n"))  # never handed over: it goes straight
        peer.flush()
        (direct,) = sent[1]
        assert direct["seq"] == 2 and direct["after"] == 1
        assert run.in_order([direct]) == []  # the notebook waits for the first
        relay.flush()
        (message,) = sent[0]
        shown = run.in_order(message if isinstance(message, list) else [message])
        assert [(b["rank"], b["seq"]) for b in shown] == [(1, 1), (1, 2)]
        run.feed(shown)
        assert run.has_all({1: 2})
    finally:
        peer.end_relay()
        relay.end_relay()
        peer.close()
        relay.close()


def test_a_held_batch_is_let_go_when_the_run_ends_or_after_a_while(monkeypatch):
    run = Run("cell", [0, 1], world_size=2)
    late = {**batch(1, 5), "after": 4}
    assert run.in_order([late, batch(0, 1)]) == [batch(0, 1)]
    assert not run.has_all({1: 5})
    assert run.in_order([], release=True) == [late]  # the last pass: nothing waits
    run2 = Run("cell", [0, 1], world_size=2)
    assert run2.in_order([late]) == []
    monkeypatch.setattr("nbdist.telemetry.run.HOLD_S", 0.0)  # a relay that died took the 4th
    assert run2.in_order([]) == [late]


def test_batches_in_one_drain_are_put_in_their_order():
    run = Run("cell", [1], world_size=2)
    a, b, c = batch(1, 1), {**batch(1, 2), "after": 1}, {**batch(1, 3), "after": 2}
    assert run.in_order([c, b, a]) == [a, b, c]
    assert node_relay.URGENT_MARK != node_relay.PLAIN_MARK


def test_hosts_given_spread_shares_send_at_spread_moments():
    went = threading.Event()
    sink = EventSink(0, lambda b: went.set(), interval=60)
    try:
        sink.flush()  # a cell begins: the next batch is due an interval from now ...
        sink.emit(ev.stream("stdout", "hi\n"))
        assert not went.wait(0.3)
        sink.stagger(0.999)  # ... less this host's share of it: about now
        assert went.wait(5)
    finally:
        sink.close()


def test_output_and_reports_never_go_through_the_relay(private_tmp):
    relay, peer, sent = sinks(private_tmp)
    try:
        peer.emit(ev.stream("stdout", "a line\n"))
        steps(peer, 0)  # with the output: the batch goes straight, steps and all
        peer.flush()
        (direct,) = sent[1]
        assert "after" not in direct and {e["kind"] for e in direct["events"]} >= {"stream"}
        steps(peer, 2)
        peer.flush()
        assert len(sent[1]) == 1 and peer.peer.handed == 1
        peer.peer.gone = True  # a relay that died: the rank's figures go straight again
        steps(peer, 4)
        peer.flush()
        assert sent[1][-1]["seq"] == 3 and sent[1][-1]["after"] == 2
    finally:
        peer.end_relay()
        relay.end_relay()
        peer.close()
        relay.close()


def test_a_socket_a_dead_relay_left_a_day_ago_is_removed_by_the_next_relay(private_tmp):
    stale, fresh = relay_path("old-cell", 0), relay_path("recent-cell", 0)
    for path in (stale, fresh):
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.bind(path)  # bound, never unbound: what a relay that died leaves
    day_ago = os.stat(stale).st_mtime - node_relay.STALE_S - 60
    os.utime(stale, (day_ago, day_ago), follow_symlinks=False)
    Relay(relay_path("cell", 0), peers=1, interval=1).close()
    assert not os.path.exists(stale) and os.path.exists(fresh)
