"""A node's forwarder against a real collector: ranks' frames reach the notebook, a notebook
that is away costs the job dropped batches, counted and told, and a notebook that comes back
(a restarted kernel on the same line) learns the job again."""

from __future__ import annotations

import time

import pytest
from synthetic import batches, training_events

from nbdist.agent import forwarder as fwd
from nbdist.agent import wire
from nbdist.agent.spool import SpoolWriter
from nbdist.telemetry import events as ev
from nbdist.watch.collector import Collector

JOB = "torchrun-t"


def _until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(fwd, "BACKOFF", (0.05, 0.2))


def _rank_writes(spool, rank, pid, steps, world=2):
    w = SpoolWriter(str(spool), pid=pid)
    w.write(wire.encode({"type": "rank", "job": JOB, "rank": rank, "world_size": world,
                         "local_rank": rank, "host": "n1", "pid": pid, "restart": 0}), False)
    for b in batches(rank, training_events(steps) + [ev.end(True, 0.0)]):
        w.write(wire.encode({"type": "batch", "job": JOB, "batch": b}))
    return w


def _exit(w, rank):
    w.write(wire.encode({"type": "exit", "job": JOB, "rank": rank, "pid": w.pid, "ok": True,
                         "error": None, "lost": False}), False)


def test_ranks_frames_reach_the_notebook_over_one_connection(tmp_path):
    c = Collector()
    f = fwd.Forwarder(c.address, str(tmp_path), owns_directory=False).start()
    try:
        import os
        ws = [_rank_writes(tmp_path, r, os.getpid(), 5, world=1) for r in (0,)]
        _until(lambda: c.jobs.records() and c.jobs.records()[0].steps == {0: 5})
        _until(lambda: not f._unacked and f._queued == 0)  # it acknowledged what it folded
        _exit(ws[0], 0)
        assert f.connected and c.accepted == 1
        time.sleep(3 * fwd.POLL)
        assert c.jobs.records()[0].state == "running"  # the launcher may restart it
        f.close(timeout=2)  # the launcher ends: its bye
        _until(lambda: c.jobs.records()[0].state == "finished")
    finally:
        f.close(timeout=2)
        c.close()


def test_a_rank_that_vanishes_unsaid_is_reported_lost(tmp_path):
    c = Collector()
    f = fwd.Forwarder(c.address, str(tmp_path), owns_directory=False).start()
    try:
        dead = 2 ** 22 + 12345  # above the default pid_max: no such process
        _rank_writes(tmp_path, 0, dead, 2, world=1)
        _until(lambda: c.jobs.records() and "ended without saying how"
               in "".join(c.jobs.get("1").notes))
        f.close(timeout=2)
        _until(lambda: c.jobs.records()[0].state == "lost")
    finally:
        f.close(timeout=2)
        c.close()


def test_a_notebook_away_costs_dropped_batches_then_it_learns_the_job_and_the_count(tmp_path):
    import os

    c = Collector()
    address = c.address
    c.close()  # the kernel is away: its port refuses
    f = fwd.Forwarder(address, str(tmp_path), max_queued=3000, owns_directory=False)
    w = _rank_writes(tmp_path, 0, os.getpid(), 20, world=1)
    f.poll()
    assert not f.send() and not f.connected
    dropped = sum(f.dropped.values())
    assert dropped > 0 and f._queued <= 3000  # bounded
    f.start()
    back = Collector(port=address.port, token=address.token)  # the same line again
    try:
        _until(lambda: back.jobs.records() and back.jobs.records()[0].dropped == dropped)
        rec = back.jobs.records()[0]
        assert 0 < sum(rec.steps.values()) < 20  # what was not dropped
        # the kernel restarts again: the job's ranks are sent again, and its end then
        back.close()
        again = Collector(port=address.port, token=address.token)
        try:
            _until(lambda: again.jobs.records() and again.accepted == 1, timeout=15)
            _exit(w, 0)
            f.close(timeout=5)
            _until(lambda: again.jobs.records()[0].state == "finished")
        finally:
            again.close()
    finally:
        f.close(timeout=1)
        back.close()


def test_stacks_asked_in_the_notebook_come_back_from_the_ranks_main_thread(tmp_path):
    from nbdist.agent.rank import RankAgent

    c = Collector()
    f = fwd.Forwarder(c.address, str(tmp_path), owns_directory=False).start()
    env = {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "t"}
    agent = RankAgent(str(tmp_path), env)
    agent._send({"type": "rank", "job": agent.job, **agent.who, "host": "n1",
                 "pid": __import__("os").getpid()}, droppable=False)
    seen: set[str] = set()
    import threading

    answering = threading.Thread(target=agent._commands, args=(seen,), daemon=True)
    answering.start()
    try:
        _until(lambda: c.jobs.records() and f.connected)
        stacks = c.stacks(JOB, timeout=10)
        # this test's own frame: the main thread was here, waiting for the answer
        assert list(stacks) == [0]
        assert "in test_stacks_asked_in_the_notebook_come_back" in stacks[0]
        assert "c.stacks(JOB, timeout=10)" in stacks[0]
        assert c.stacks(JOB, rank=1, timeout=0.3) == {}  # rank 1 never began
        assert c.stacks("no-such-job") == {}
        agent._ended = True  # an agent that stopped answering
        answering.join(timeout=5)
        silent = c.stacks(JOB, timeout=0.3)
        assert silent[0].startswith("(rank 0 did not answer within 0.3 s")
    finally:
        agent._ended = True
        f.close(timeout=1)
        c.close()


@pytest.mark.skipif(__import__("shutil").which("openssl") is None,
                    reason="needs the openssl command")
def test_over_tls_the_forwarder_reports_and_answers_commands(tmp_path):
    import os
    import subprocess

    cert, key = str(tmp_path / "c.pem"), str(tmp_path / "k.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=localhost"], check=True,
                   capture_output=True, timeout=60)
    spool = tmp_path / "spool"
    spool.mkdir()
    c = Collector(tls=(cert, key))
    assert c.address.scheme == "tls"
    f = fwd.Forwarder(c.address, str(spool), owns_directory=False).start()
    try:
        w = _rank_writes(spool, 0, os.getpid(), 4, world=1)
        _until(lambda: c.jobs.records() and c.jobs.records()[0].steps == {0: 4})
        time.sleep(3 * fwd.POLL)
        assert f.connected  # an idle TLS connection is not taken for a closed one
        c.stacks(JOB, timeout=0.5)  # the command crosses TLS and becomes a file
        _until(lambda: any(p.name.startswith("cmd-stacks-") for p in spool.iterdir()))
        _exit(w, 0)
        f.close(timeout=3)
        _until(lambda: c.jobs.records()[0].state == "finished")
        assert c.accepted == 1
    finally:
        f.close(timeout=1)
        c.close()


def test_a_detached_job_is_no_longer_sent_while_the_nodes_other_jobs_are(tmp_path):
    c = Collector()
    heard: list = []  # every message the collector took, in order
    fold_all = c.jobs.fold_all
    c.jobs.fold_all = lambda ms: (heard.extend(m for m, _ in ms), fold_all(ms))  # type: ignore
    f = fwd.Forwarder(c.address, str(tmp_path), owns_directory=False).start()
    try:
        import os
        w = _rank_writes(tmp_path, 0, os.getpid(), 3, world=1)
        _until(lambda: c.jobs.records() and c.jobs.records()[0].steps == {0: 3})
        assert c.detach("1") and c.jobs.records() == [] and not c.detach("1")
        _until(lambda: JOB in f.detached)
        told = len(heard)
        # the job goes on writing; another job of the node reports after it, on one spool
        for b in batches(0, training_events(2)):
            w.write(wire.encode({"type": "batch", "job": JOB, "batch": b}))
        _exit(w, 0)
        w.write(wire.encode({"type": "rank", "job": "other", "rank": 0, "world_size": 1,
                             "local_rank": 0, "host": "n1", "pid": 7, "restart": 0}), False)
        _until(lambda: [r.key for r in c.jobs.records()] == ["other"])
        assert [m.get("job") for m in heard[told:]] == ["other"]
        f.close(timeout=2)  # its launcher does not wait for the detached job's ranks
        assert not any(m.get("job") == JOB for m in heard[told:])
    finally:
        f.close(timeout=1)
        c.close()


def test_a_collector_of_the_first_protocol_gets_bytes_as_base64_in_the_json(tmp_path):
    import os
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)
    address = wire.Address("tcp", "127.0.0.1", server.getsockname()[1], "tok")
    f = fwd.Forwarder(address, str(tmp_path), owns_directory=False).start()
    conn = None
    try:
        conn, _ = server.accept()
        conn.settimeout(10)
        buf = bytearray()
        while not wire.split(buf, wire.MAX_HELLO):
            buf += conn.recv(4096)
        conn.sendall(wire.encode({"ok": True}))  # as a collector of protocol 1 answers
        from nbdist.telemetry.columns import pack

        w = SpoolWriter(str(tmp_path), pid=os.getpid())
        packed = {"rank": 0, "seq": 1, "events": pack(training_events(3))}  # as a sink sends
        w.write(wire.encode({"type": "batch", "job": JOB, "batch": packed}))
        bodies: list[bytes] = []
        deadline = time.monotonic() + 10
        while not any(b'"batch"' in b for b in bodies) and time.monotonic() < deadline:
            buf += conn.recv(1 << 16)
            bodies += wire.split(buf)
        sent = [b for b in bodies if b'"batch"' in b]
        assert sent and all(b[:1] == b"{" and b'"$b"' in b for b in sent)
        events = wire.decode(sent[0])["batch"]["events"]
        assert any(isinstance(c, bytes) for e in events if e.get("kind") == "table"
                   for p in e["parts"] for c in p["columns"])
    finally:
        f.close(timeout=1)
        if conn is not None:
            conn.close()
        server.close()



class _Notebook:
    """A collector's end played by hand on a real socket: it answers the hello (saying it
    acknowledges, or not: a notebook of before acknowledgements), reads frames, and
    acknowledges as many as the test says."""

    def __init__(self, server, acks=True):
        self.conn, _ = server.accept()
        self.conn.settimeout(10)
        self.buf = bytearray()
        self.frames: list[dict] = []
        hello = self._next()
        assert hello["token"] == "t"
        answer = {"ok": True, "nbdist": wire.PROTOCOL, **({"acks": True} if acks else {})}
        self.conn.sendall(wire.encode(answer, wire.JSON_PROTOCOL))

    def _next(self) -> dict:
        while not self.frames:
            chunk = self.conn.recv(65536)
            assert chunk, "the forwarder closed the connection"
            self.buf += chunk
            self.frames += [wire.decode(b) for b in wire.split(self.buf)]
        return self.frames.pop(0)

    def take(self, batches: int) -> list[dict]:
        """Frames up to the ``batches``-th batch."""
        out = []
        while sum(m["type"] == "batch" for m in out) < batches:
            out.append(self._next())
        return out

    def ack(self, frames: int) -> None:
        self.conn.sendall(wire.encode({"type": "ack", "frames": frames}, wire.JSON_PROTOCOL))


def _line_and_server():
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    return wire.parse(f"tcp://127.0.0.1:{server.getsockname()[1]}/t"), server


def test_frames_a_notebook_never_acknowledged_go_to_the_next_one(tmp_path):
    """A kernel that dies holds frames it read (or never read) and never folded: the next
    notebook on the line gets them, after who the ranks are, and nothing it was told it
    took is sent again."""
    import os

    address, server = _line_and_server()
    _rank_writes(tmp_path, 0, os.getpid(), 20, world=1)  # a rank frame, then 6 batches
    f = fwd.Forwarder(address, str(tmp_path), owns_directory=False).start()
    try:
        first = _Notebook(server)
        got = first.take(6)
        # who the rank is comes first on every connection (here twice: read before the
        # first connection, and said again as every connection begins)
        ranks = next(i for i, m in enumerate(got) if m["type"] == "batch")
        assert ranks in (1, 2) and {m["type"] for m in got[:ranks]} == {"rank"}
        seqs = [m["batch"]["seq"] for m in got[ranks:]]
        assert seqs == sorted(seqs) and len(seqs) == 6
        first.ack(ranks + 2)  # the rank and two batches folded; four read, never folded
        _until(lambda: len(f._unacked) == 4)
        first.conn.close()  # the kernel dies
        second = _Notebook(server)  # restarted, on the same line
        again = second.take(4)
        assert [m["type"] for m in again] == ["rank"] + ["batch"] * 4
        assert [m["batch"]["seq"] for m in again[1:]] == seqs[2:]  # what was not taken
        second.ack(5)
        _until(lambda: not f._unacked and f._queued == 0)  # what was taken is let go
    finally:
        f.close(timeout=0.5)
        server.close()


def test_a_notebook_that_does_not_acknowledge_gets_each_frame_once(tmp_path):
    """A notebook of before acknowledgements: nothing is kept once sent, as before."""
    import os

    address, server = _line_and_server()
    _rank_writes(tmp_path, 0, os.getpid(), 20, world=1)
    f = fwd.Forwarder(address, str(tmp_path), owns_directory=False).start()
    try:
        old = _Notebook(server, acks=False)
        old.take(6)
        _until(lambda: f._queued == 0)
        assert not f._unacked
    finally:
        f.close(timeout=0.5)
        server.close()
