"""A node's one connection to the notebook: the ranks' spool files, read and sent on.

The forwarder lives in the launcher's process where there is one (``torchrun``'s agent, alive
across its ranks' restarts), else in the rank that won the node's lock (:mod:`.hook`). It is
one daemon thread: it reads the ranks' spool files (:class:`~.spool.SpoolReader`), keeps what
it read in a bounded queue, and sends it to the notebook's collector when connected. The job
never waits for the notebook: an unreachable notebook means reconnection with back-off
(:data:`BACKOFF`), and a full queue drops batches and counts them (the notebook is told the
count); the frames that say who each rank is and how it ended are kept and sent again on every
new connection, so a restarted notebook learns the job again. A collector that acknowledges
what it took (its answer says ``acks``) has each frame sent to it kept until it says so:
what a notebook that went away never took (in flight, or unread in its socket) goes to the
next one, and counts toward the queue's bound meanwhile.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import ssl
import sys
import threading
import time
from collections import deque
from typing import Any, Optional

from . import wire
from .spool import COMMAND_PREFIX, COMMAND_TTL, SpoolReader, claim, running, sweep, write_command

#: seconds between looks at the spool files
POLL = 0.1
#: bytes of batches held for the notebook before new ones are dropped
MAX_QUEUED = 64 << 20
#: seconds before the first reconnection, and the most between two
BACKOFF = (0.5, 10.0)
#: seconds a connection attempt or one send may take
IO_TIMEOUT = 5.0
class Forwarder:
    """Reads the spool ``directory`` and sends what it holds to ``address``."""

    def __init__(self, address: wire.Address, directory: str, *,
                 max_queued: int = MAX_QUEUED, owns_directory: bool = True):
        self.address = address
        self.directory = directory
        self.owns_directory = owns_directory
        self.host = socket.gethostname()
        self.max_queued = max_queued
        self._reader = SpoolReader(directory)
        self._queue: deque[bytes] = deque()
        self._queued = 0
        self._kept: dict[int, list[bytes]] = {}  # pid -> its rank and exit frames
        self._ranks: dict[int, dict[str, Any]] = {}  # pid -> its rank frame
        self._ended: set[int] = set()
        self.detached: set[str] = set()  # jobs the notebook stopped watching: not sent
        self.dropped: dict[tuple[str, int], int] = {}  # (job, rank) -> batches dropped here
        self._dropped_sent: dict[tuple[str, int], int] = {}
        self._sock: Optional[socket.socket] = None
        #: frames sent down this connection and not yet acknowledged, oldest first, and how
        #: many the collector acknowledged so far (None: it does not acknowledge)
        self._unacked: deque[bytes] = deque()
        self._acked: Optional[int] = None
        self._protocol = wire.PROTOCOL  # the connected collector's (see wire.PROTOCOL)
        self._retry_at = 0.0
        self._backoff = BACKOFF[0]
        self._connected_once = False
        self._inbox = bytearray()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="nbdist-forwarder",
                                        daemon=True)

    def start(self) -> Forwarder:
        if self.owns_directory:  # say whose it is; remove what killed forwarders left
            claim(self.directory)
            sweep(os.path.dirname(os.path.abspath(self.directory)))
        self._thread.start()
        return self

    @property
    def connected(self) -> bool:
        return self._sock is not None

    # ------------------------------------------------------------------ reading
    def poll(self) -> None:
        """Take what the ranks wrote since the last look; a rank that vanished without its
        exit frame is reported lost (looked at before reading: its last words are in)."""
        dead = [pid for pid in self._ranks if pid not in self._ended and not running(pid)]
        for pid, frame in self._reader.read():
            try:
                msg = wire.decode(frame[4:])
            except ValueError:
                continue
            kind = msg.get("type")
            if msg.get("job") in self.detached:
                continue
            if kind == "batch":
                self._enqueue_batch(msg, frame)
                continue
            if kind == "rank":
                self._ranks[pid] = msg
                self._kept[pid] = [frame]
            elif kind == "exit":
                self._ended.add(pid)
                self._kept.setdefault(pid, []).append(frame)
            self._enqueue(frame)
        for pid in dead:
            if pid in self._ended:
                continue
            self._ended.add(pid)
            msg = self._ranks[pid]
            frame = wire.encode({"type": "exit", "job": msg["job"], "rank": msg["rank"],
                                 "pid": pid, "ok": False, "error": None, "lost": True,
                                 "t": time.time()})
            self._kept.setdefault(pid, []).append(frame)
            self._enqueue(frame)

    def _enqueue(self, frame: bytes) -> None:
        self._queue.append(frame)
        self._queued += len(frame)

    def _enqueue_batch(self, msg: dict[str, Any], frame: bytes) -> None:
        if self._queued + len(frame) > self.max_queued:
            key = (str(msg.get("job")), int(msg.get("batch", {}).get("rank", -1)))
            self.dropped[key] = self.dropped.get(key, 0) + 1
            return
        self._enqueue(frame)

    # ------------------------------------------------------------------ sending
    def _connect(self) -> bool:
        addr = self.address
        sock: Optional[socket.socket] = None
        try:
            sock = socket.create_connection((addr.host, addr.port), timeout=IO_TIMEOUT)
            if addr.scheme == "tls":
                ctx = ssl.create_default_context()
                # The token authenticates the notebook's end; a self-signed certificate is
                # the usual case, and the channel is what TLS is asked for here.
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
                sock = ctx.wrap_socket(sock, server_hostname=addr.host)
            sock.sendall(wire.hello(addr.token, self.host, os.getpid()))
            answer = bytearray()
            while not (bodies := wire.split(answer, wire.MAX_HELLO)):
                chunk = sock.recv(4096)
                if not chunk:
                    raise ConnectionError("the collector closed the connection")
                answer += chunk
            said = wire.decode(bodies[0])
            if not said.get("ok"):
                raise ConnectionError("the collector refused the token")
            # an older notebook reads bytes as base64 in the JSON only
            protocol = said.get("nbdist")
            self._protocol = protocol if isinstance(protocol, int) else 1
            self._acked = 0 if said.get("acks") else None
        except (OSError, ValueError, ConnectionError):
            if sock is not None:
                sock.close()
            return False
        self._sock = sock
        self._connected_once = True
        self._inbox = bytearray()
        self._dropped_sent = {}
        # Everything a new notebook needs to know first: the ranks, and how some ended.
        self._queue.extendleft(reversed([f for frames in self._kept.values() for f in frames]))
        self._queued += sum(len(f) for frames in self._kept.values() for f in frames)
        return True

    def _disconnect(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        # What the collector never said it took goes first to the next one (after who the
        # ranks are, which every connection begins with: not twice)
        kept = {id(f) for frames in self._kept.values() for f in frames}
        again = [f for f in self._unacked if id(f) not in kept]
        self._queued -= sum(len(f) for f in self._unacked if id(f) in kept)
        self._queue.extendleft(reversed(again))
        self._unacked.clear()
        self._acked = None
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF[1])

    def _read_commands(self) -> bool:
        """Take the notebook's commands that arrived (a request for stacks becomes a file the
        ranks look for); False if the notebook closed the connection (a restarted kernel is
        then found again)."""
        assert self._sock is not None
        try:
            while select.select([self._sock], [], [], 0)[0]:
                self._sock.settimeout(0)  # readable may be TLS records without data
                try:
                    chunk = self._sock.recv(65536)
                except (BlockingIOError, ssl.SSLWantReadError):
                    break
                finally:
                    self._sock.settimeout(IO_TIMEOUT)
                if not chunk:
                    return False
                self._inbox += chunk
                for body in wire.split(self._inbox, wire.MAX_HELLO):
                    self._command(wire.decode(body))
        except (OSError, ValueError):
            return False
        return True

    def _command(self, msg: dict[str, Any]) -> None:
        if msg.get("type") == "ack" and isinstance(msg.get("frames"), int):
            self._took(msg["frames"])
        elif msg.get("type") == "stacks" and isinstance(msg.get("id"), int):
            write_command(self.directory, msg)
        elif msg.get("type") == "detach" and isinstance(msg.get("job"), str):
            self._detach(msg["job"])

    def _took(self, frames: int) -> None:
        """The collector took the first ``frames`` frames of this connection: they go."""
        if self._acked is None:
            return
        while self._acked < frames and self._unacked:
            self._queued -= len(self._unacked.popleft())
            self._acked += 1

    def _detach(self, job: str) -> None:
        """Send nothing more of ``job`` (the notebook stopped watching it): what is queued
        of it goes, and what its ranks write from now on is read and let go."""
        self.detached.add(job)
        ours = [pid for pid, m in self._ranks.items() if m.get("job") == job]
        for pid in ours:
            self._kept.pop(pid, None)
            self._ended.add(pid)  # not reported lost either
        kept: deque[bytes] = deque()
        for frame in self._queue:
            try:
                if wire.decode(frame[4:]).get("job") == job:
                    self._queued -= len(frame)
                    continue
            except ValueError:
                pass
            kept.append(frame)
        self._queue = kept
        for key in [k for k in self.dropped if k[0] == job]:
            del self.dropped[key]

    def _forget_commands(self) -> None:
        """Commands older than :data:`COMMAND_TTL` seconds are answered or moot: removed."""
        now = time.time()
        for name in os.listdir(self.directory):
            if name.startswith(COMMAND_PREFIX):
                path = os.path.join(self.directory, name)
                try:
                    if now - os.stat(path).st_mtime > COMMAND_TTL:
                        os.remove(path)
                except FileNotFoundError:
                    pass

    def send(self) -> bool:
        """Send what is queued; True if everything went (connecting first if it is time)."""
        if self._sock is None:
            if time.monotonic() < self._retry_at:
                return False
            if not self._connect():
                self._disconnect()  # the next try after the back-off
                return False
            self._backoff = BACKOFF[0]
        elif not self._read_commands():
            self._disconnect()
            return False
        news = {k: n for k, n in self.dropped.items() if self._dropped_sent.get(k) != n}
        for (job, rank), n in news.items():
            self._enqueue(wire.encode({"type": "dropped", "job": job, "rank": rank,
                                       "where": "node", "count": n}))
        try:
            while self._queue:
                frame = self._queue[0]
                self._sock.sendall(wire.for_protocol(frame, self._protocol))
                self._queue.popleft()
                if self._acked is None:
                    self._queued -= len(frame)
                else:  # kept until the collector says it took it
                    self._unacked.append(frame)
        except OSError:
            self._disconnect()
            return False
        self._dropped_sent.update(news)
        return True

    def _loop(self) -> None:
        while not self._stop.wait(POLL):
            try:
                with self._lock:
                    self.poll()
                    self.send()
                    self._forget_commands()
            except Exception as exc:  # the job must not notice: say it once, stop reporting
                sys.__stderr__.write(f"nbdist: attach forwarder stopped: {exc!r}\n")
                return

    def close(self, wait_for_ranks: float = 0.0, timeout: float = 3.0,
              code: Optional[int] = None) -> None:
        """Stop: wait up to ``wait_for_ranks`` seconds for every rank's end, send the rest
        and a ``bye`` (for at most ``timeout`` seconds to a notebook that was reached; one
        try to one never reached), remove the spool directory."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=IO_TIMEOUT + 1)
        deadline = time.monotonic() + wait_for_ranks
        with self._lock:
            self.poll()
            while set(self._ranks) - self._ended and time.monotonic() < deadline:
                time.sleep(POLL)
                self.poll()
            self._enqueue(wire.encode({"type": "bye", "code": code, "t": time.time()}))
            end = time.monotonic() + timeout
            self._retry_at = 0.0
            # A notebook never reached gets one more try, not ``timeout`` seconds of the
            # launcher's exit; one that was there gets them to take the last frames.
            while (not self.send() and self._connected_once
                   and time.monotonic() < end):
                time.sleep(POLL)
                self._retry_at = 0.0  # the last moments: no back-off
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        if self.owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
