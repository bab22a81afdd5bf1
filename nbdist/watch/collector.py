"""``%nbdist attach``: the kernel's listener for jobs started elsewhere.

One :class:`Collector` per kernel. It listens on loopback and a free port unless told another
``HOST:PORT``, and answers only connections whose first frame carries its token (compared in
constant time); others are closed unanswered. Each job's node forwarder
(:mod:`nbdist.agent.forwarder`) keeps one connection. One thread reads them all, and folds
what they sent into :class:`~.watched.Jobs` every :data:`FOLD_INTERVAL` seconds, in one go (a
job's run settles what a feed changed once per feed, not once per frame). With a certificate
and key the connections are TLS.

The token can live in a file (mode 0600) holding the whole attach line: a restarted kernel
that is given the same file listens again on the same address with the same token, and the
running job's forwarders, which retry, find it again.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import selectors
import site
import socket
import ssl
import threading
import time
from collections import deque
from typing import Optional

from ..agent import wire
from ..errors import AttachError
from .settings import parse_listen, read_token_file, server_context, write_token_file
from .watched import RUNNING, Jobs

__all__ = ["AttachError", "Collector", "attach", "current", "hook_installed", "missing_job",
           "no_jobs"]

#: seconds between two acknowledgements down one connection: what a forwarder sent and this
#: collector took, which it need not send again (it keeps the rest for the next connection)
ACK_INTERVAL = 1.0
#: seconds a new connection has to present its token
HELLO_TIMEOUT = 10.0
#: seconds a job whose connection ended without a bye waits for another to carry it
TAKE_OVER = 3.0
LOOPBACK = "127.0.0.1"
#: seconds a command sent down a connection may wait for it
IO_TIMEOUT = 5.0
#: bytes one read of a connection takes at most
RECV_BYTES = 256 << 10
_ACCEPT, _WAKE = object(), object()  # the loop's own sockets, as the selector names them


class _Reading:
    """A connection the loop reads: its number, and what it sent of a frame so far."""

    __slots__ = ("ident", "buf")

    def __init__(self, ident: int, buf: bytearray):
        self.ident, self.buf = ident, buf
#: seconds between two folds of what the connections decoded (as a cell's loop polls its job)
FOLD_INTERVAL = 0.1


class Collector:
    """Listens for jobs' node forwarders and folds what they send into :attr:`jobs`.

    Parameters
    ----------
    host : str
        The interface to listen on (default loopback: only this machine's jobs reach it).
    port : int
        The port (0: a free one).
    token : str, optional
        The token connections must carry (default: a fresh one).
    tls : (str, str), optional
        Certificate and key files: connections are TLS.

    Raises
    ------
    AttachError
        A TLS file is missing, unreadable or not PEM, or the key is not the certificate's.
    OSError
        The address cannot be listened on (in use, not this machine's).
    """

    def __init__(self, host: str = LOOPBACK, port: int = 0, token: Optional[str] = None,
                 tls: Optional[tuple[str, str]] = None):
        self.token = token or wire.new_token()
        self.jobs = Jobs()
        #: the certificate and key files it was started with (None: plain tcp)
        self.tls = tls
        #: detached jobs, id -> key: a later look for one says it was detached
        self.detached: dict[str, str] = {}
        self._ssl: Optional[ssl.SSLContext] = None
        if tls is not None:
            self._ssl = server_context(tls[0], tls[1])
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = socket.create_server((host, port), family=family, backlog=128)
        self.host, self.port = host, self._server.getsockname()[1]
        self._ids = itertools.count(1)
        self._closed = False
        self._conns: set[socket.socket] = set()
        #: greeted connections by id, and a lock each: commands go down them
        self._links: dict[int, tuple[socket.socket, threading.Lock]] = {}
        #: frames taken from each connection, and as many as it was told it had
        self._taken: dict[int, int] = {}
        self._acked: dict[int, int] = {}
        self._ack_at = 0.0  # when acknowledgements are next due
        self._owed = False  # frames folded and not yet acknowledged
        self._asks = itertools.count(1)
        self._answers: dict[int, dict[int, str]] = {}  # request id -> rank -> stack
        self._answered = threading.Condition()
        self.refused = 0  # connections closed for a missing or wrong token
        self.accepted = 0  # connections that carried the token
        #: CPU seconds the loop spent folding (the rest of its time is reading and decoding)
        self.fold_seconds = 0.0
        #: decoded messages, each with its connection, for the next fold (None for a
        #: message: that connection ended, in its place among the messages)
        self._inbox: list[tuple[Optional[dict], int]] = []
        # from other threads to the loop: greeted connections, and ended ones whose time to
        # be taken over is up
        self._handed: deque[tuple[socket.socket, int, bytearray]] = deque()
        self._ends: deque[int] = deque()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._server, selectors.EVENT_READ, _ACCEPT)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._thread = threading.Thread(target=self._loop, name="nbdist-attach", daemon=True)
        self._thread.start()

    @property
    def address(self) -> wire.Address:
        """Where jobs reach this collector, as they are told to (a wildcard host is named by
        this machine's name)."""
        host = socket.getfqdn() if self.host in ("0.0.0.0", "::", "") else self.host
        return wire.Address("tls" if self._ssl else "tcp", host, self.port, self.token)

    @property
    def line(self) -> str:
        """``NBDIST_ATTACH=tcp://HOST:PORT/TOKEN``: what a job's environment needs."""
        return f"{wire.ENV}={self.address.line}"

    @property
    def alive(self) -> bool:
        return not self._closed

    def instructions(self) -> str:
        """The line to add to a job's environment, and how to launch with it: as it is where
        this environment has nbdist's start-up hook, else through ``-m nbdist.agent`` (a
        plain launch would report nothing)."""
        line = self.line
        if hook_installed():
            how = ("Start a job with it in its environment; every rank then reports here:\n"
                   f"  {line} torchrun --nproc_per_node=2 train.py\n"
                   f"  sbatch --export=ALL,{line} job.sh   # srun in job.sh; or torchrun\n"
                   "Without nbdist's start-up hook (an editable install), run the script as\n"
                   f"  {line} torchrun --nproc_per_node=2 -m nbdist.agent train.py\n")
        else:
            how = (f"This environment has no start-up hook ({HOOK} is not in site-packages: "
                   "an editable install), so\na job reports only with its script run "
                   "through nbdist's agent:\n"
                   f"  {line} torchrun --nproc_per_node=2 -m nbdist.agent train.py\n"
                   f"  sbatch --export=ALL,{line} job.sh   # in job.sh: srun python -m "
                   "nbdist.agent train.py\n")
        return (f"{line}\n\n{how}"
                + ("" if self.host != LOOPBACK else
                   "Listening on loopback: jobs on this machine only (--listen HOST:PORT for "
                   "others).\n"))

    def __repr__(self) -> str:
        return self.instructions()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        """Accept, read and decode every connection, and fold what they sent every
        :data:`FOLD_INTERVAL` seconds: one thread for all of a job's hosts (a thread per
        connection spent more on handing the interpreter to each other than on reading)."""
        space = memoryview(bytearray(RECV_BYTES))
        folded = time.monotonic()
        while not self._closed:
            wait = None if not self._inbox else max(0.0, folded + FOLD_INTERVAL
                                                    - time.monotonic())
            if self._owed and not self._inbox:  # what was folded is acknowledged in time
                wait = max(0.0, self._ack_at - time.monotonic())
            try:
                ready = self._selector.select(wait)
            except (OSError, ValueError):
                return  # closed under it
            for key, _ in ready:
                if key.data is _ACCEPT:
                    self._accept()
                elif key.data is _WAKE:
                    self._woken()
                else:
                    self._read(key.fileobj, key.data, space)  # type: ignore[arg-type]
            if self._inbox and time.monotonic() >= folded + FOLD_INTERVAL:
                folded = time.monotonic()
                t = time.thread_time()
                self._fold()
                self.fold_seconds += time.thread_time() - t
                self._acknowledge(folded)
            elif self._owed and not self._inbox and time.monotonic() >= self._ack_at:
                self._acknowledge(time.monotonic())

    def _accept(self) -> None:
        try:
            conn, _ = self._server.accept()
        except OSError:
            return
        # the token's check may wait for a slow client: on a thread of its own
        threading.Thread(target=self._greet, args=(conn, next(self._ids)),
                         name="nbdist-attach-hello", daemon=True).start()

    def _greet(self, conn: socket.socket, ident: int) -> None:
        """Read a new connection's first frame; one that carries the token goes to the loop,
        with what came after its first frame."""
        self._conns.add(conn)
        try:
            conn.settimeout(HELLO_TIMEOUT)
            if self._ssl is not None:
                raw = conn
                conn = self._ssl.wrap_socket(raw, server_side=True)  # takes raw's socket
                self._conns.add(conn)
                self._conns.discard(raw)
            buf = bytearray()
            while not (first := wire.split(buf, wire.MAX_HELLO)):
                chunk = conn.recv(wire.MAX_HELLO)
                if not chunk:
                    raise ConnectionError("closed before its hello")
                buf += chunk
            hello = wire.decode(first[0])
            if not wire.token_matches(hello.get("token"), self.token):
                raise ConnectionError("no token, or not this collector's")
            # "acks": this collector says what it took (a forwarder keeps what it sent until
            # then, and sends it again to the next notebook if this one goes away)
            conn.sendall(wire.encode({"ok": True, "nbdist": wire.PROTOCOL, "acks": True},
                                     wire.JSON_PROTOCOL))
        except (OSError, ValueError, ssl.SSLError):
            self.refused += 1
            self._conns.discard(conn)
            conn.close()
            return
        self.accepted += 1
        try:  # the loop reads it when it is readable; sends (stacks, detach) may wait this long
            conn.settimeout(IO_TIMEOUT)
        except OSError:  # the collector closed meanwhile
            self._conns.discard(conn)
            conn.close()
            return
        self._links[ident] = (conn, threading.Lock())
        # what came after the hello, framed again, is read first
        rest = bytearray(b"".join(wire.framed(b) for b in first[1:])) + buf
        self._handed.append((conn, ident, rest))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # closed, or already full of wakes: the loop wakes anyway

    def _woken(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass
        while self._ends:
            self._inbox.append((None, self._ends.popleft()))
        while self._handed:
            conn, ident, buf = self._handed.popleft()
            if self._closed:
                conn.close()
                continue
            try:
                self._selector.register(conn, selectors.EVENT_READ, _Reading(ident, buf))
            except (OSError, ValueError, KeyError):
                # closed meanwhile, by close() on another thread (seen in a test's teardown):
                # the thread goes on to its end rather than dying on it
                self._drop(conn, ident)
                continue
            self._take(conn, ident, buf)

    def _read(self, conn: socket.socket, reading: _Reading, space: memoryview) -> None:
        try:
            # into one buffer: recv(n) would allocate n bytes per call and shrink them,
            # which cost more than the decoding at 1 MiB
            n = conn.recv_into(space)
            if n:
                reading.buf += space[:n]
                pending = conn.pending() if isinstance(conn, ssl.SSLSocket) else 0
                while pending:  # decrypted bytes select cannot see
                    n = conn.recv_into(space, min(pending, len(space)))
                    reading.buf += space[:n]
                    pending = conn.pending()
                self._take(conn, reading.ident, reading.buf)
                return
        except (OSError, ValueError, ssl.SSLError):
            pass
        self._drop(conn, reading.ident)

    def _take(self, conn: socket.socket, ident: int, buf: bytearray) -> None:
        try:
            bodies = wire.split(buf)
        except ValueError:
            self._drop(conn, ident)
            return
        if bodies:
            self._inbox += [(body, ident) for body in bodies]
            self._taken[ident] = self._taken.get(ident, 0) + len(bodies)
            self._owed = True

    def _acknowledge(self, now: float) -> None:
        """Tell each connection how many of its frames were folded (every
        :data:`ACK_INTERVAL` seconds at most); called right after a fold."""
        if now < self._ack_at:
            return
        self._ack_at = now + ACK_INTERVAL
        self._owed = False
        for ident, n in self._taken.items():
            link = self._links.get(ident)
            if link is None or self._acked.get(ident) == n:
                continue
            self._acked[ident] = n
            try:
                with link[1]:
                    link[0].sendall(wire.encode({"type": "ack", "frames": n},
                                                wire.JSON_PROTOCOL))
            except OSError:
                pass  # a connection gone: its forwarder sends it all again to the next

    def _drop(self, conn: socket.socket, ident: int) -> None:
        """A connection ended (or sent what is no frame)."""
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        self._links.pop(ident, None)
        self._taken.pop(ident, None)
        self._acked.pop(ident, None)
        self._conns.discard(conn)
        conn.close()
        # a forwarder gone without its bye may be taken over by another rank of its node in
        # moments: its jobs read lost only if none was
        later = threading.Timer(TAKE_OVER, self._ended, (ident,))
        later.daemon = True
        later.start()

    def _ended(self, ident: int) -> None:
        self._ends.append(ident)
        self._wake()

    def _fold(self) -> None:
        """Fold what the connections sent since the last fold, in their order."""
        taken: list[tuple[dict, int]] = []
        for body, ident in self._inbox:
            if body is not None:
                try:
                    message = wire.decode(body)
                except ValueError:
                    continue
                if message.get("type") == "stacks":
                    self._answer(message)
                else:
                    taken.append((message, ident))
                continue
            self.jobs.fold_all(taken)
            taken = []
            self.jobs.closed(ident)
        self._inbox = []
        self.jobs.fold_all(taken)

    def _answer(self, message: dict) -> None:
        with self._answered:
            answers = self._answers.get(message.get("id"))  # type: ignore[arg-type]
            if answers is not None and isinstance(message.get("rank"), int):
                answers[message["rank"]] = str(message.get("text", ""))
                self._answered.notify_all()

    def stacks(self, key: str, rank: Optional[int] = None,
               timeout: float = 10.0) -> dict[int, str]:
        """Every running rank's Python stack now (or ``rank``'s), asked through the job's
        forwarders: {rank: stack as text}. A rank that does not answer within ``timeout``
        seconds is there with a line that says so."""
        job = self.jobs.get(key)
        if job is None:
            return {}
        with self.jobs.lock:
            # a job that is not running has no rank to answer (one that never said its end
            # is gone all the same): asking would only wait out the timeout
            wanted = {r for r, p in job.ranks.items()
                      if p.ended is None and (rank is None or r == rank)
                      } if job.state == RUNNING else set()
            links = [self._links[c] for c in job.connections if c in self._links]
        if not wanted:
            return {}
        ask = next(self._asks)
        with self._answered:
            self._answers[ask] = {}
        # "ranks": the running ones only; a rank that ended and left its process behind
        # (or an agent of before this field) would answer to "rank" alone
        frame = wire.encode({"type": "stacks", "id": ask, "job": job.key, "rank": rank,
                             "ranks": sorted(wanted)}, wire.JSON_PROTOCOL)
        for conn, lock in links:
            try:
                with lock:
                    conn.sendall(frame)
            except OSError:
                pass
        end = time.monotonic() + timeout
        with self._answered:
            while not wanted <= set(self._answers[ask]) and time.monotonic() < end:
                self._answered.wait(max(0.0, end - time.monotonic()))
            got = self._answers.pop(ask)
        for r in wanted - set(got):
            got[r] = (f"(rank {r} did not answer within {timeout:g} s: its main thread may "
                      "hold the interpreter in a C call, or its node's forwarder is gone)\n")
        return dict(sorted(got.items()))

    def detach(self, key: str) -> bool:
        """Stop watching job ``key`` (its number or key): its node forwarders are told to
        send nothing more of it, and its record goes. False: no such job."""
        job = self.jobs.get(key)
        if job is None:
            return False
        self.detached[job.id] = job.key
        with self.jobs.lock:
            links = [self._links[c] for c in job.connections if c in self._links]
        frame = wire.encode({"type": "detach", "job": job.key}, wire.JSON_PROTOCOL)
        for conn, lock in links:
            try:
                with lock:
                    conn.sendall(frame)
            except OSError:
                pass  # a forwarder gone: nothing more comes from it anyway
        self.jobs.detach(job.key)
        return True

    def close(self) -> None:
        """Stop listening (jobs' forwarders keep retrying, and a new collector on the same
        address and token takes them back)."""
        self._closed = True
        self._wake()
        for sock in [self._server, *list(self._conns)]:
            try:  # shutdown wakes a thread blocked on it; close alone would not
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self._thread.join(timeout=2)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()


_current: Optional[Collector] = None
_lock = threading.Lock()


#: the start-up hook's file, which installing nbdist puts in site-packages (setup.py)
HOOK = "nbdist-attach.pth"


def hook_installed() -> bool:
    """Whether this environment has nbdist's start-up hook (:data:`HOOK` in a site-packages
    directory Python reads ``.pth`` files from): where it has not (an editable install), a
    plain ``torchrun train.py`` reports nothing."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return any(os.path.isfile(os.path.join(d, HOOK)) for d in dirs)


def current() -> Optional[Collector]:
    """The kernel's collector, if ``attach`` started one."""
    return _current if _current is not None and _current.alive else None


def _tls_text(tls: Optional[tuple[str, str]]) -> str:
    return (f"TLS (certificate {tls[0]}, key {tls[1]})" if tls is not None
            else "plain tcp:// (no certificate)")


def _same_tls(running: Optional[tuple[str, str]], asked: Optional[tuple[str, str]]) -> bool:
    if running is None or asked is None:
        return running is asked
    return all(os.path.realpath(a) == os.path.realpath(b) for a, b in zip(running, asked))


def _close_call(running: Collector) -> str:
    """The call that reaches ``running`` to close it (attach with its own TLS files)."""
    if running.tls is None:
        return "nbdist.attach().close()"
    return f"nbdist.attach(tls_cert={running.tls[0]!r}, tls_key={running.tls[1]!r}).close()"


def attach(listen: Optional[str] = None, token_file: Optional[str] = None,
           tls_cert: Optional[str] = None, tls_key: Optional[str] = None) -> Collector:
    """The kernel's collector, started on first use (see :func:`nbdist.attach`).

    Raises
    ------
    AttachError
        Bad options (a token file that is a directory or others may read, a TLS file
        missing or not PEM), or a running collector that listens elsewhere than asked, or
        with other TLS settings (TLS asked of a plain one, or other files; a call that
        names no TLS files keeps the running collector, TLS or not).
    OSError
        The address cannot be listened on.
    """
    global _current
    if (tls_cert is None) != (tls_key is None):
        raise AttachError.half_tls()
    host, port = parse_listen(listen)
    if token_file is not None and os.path.isdir(token_file):
        raise AttachError.token_file_dir(token_file)
    tls = (tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None
    with _lock:
        running = current()
        if running is not None:
            if (host is not None and host != running.host) or (port and port != running.port):
                raise AttachError.listening_elsewhere(running.host, running.port,
                                                      _close_call(running))
            # the line printed must be what was asked for: a plain line where TLS was
            # asked would send the token in clear text (asking nothing keeps what runs, as
            # leaving out --listen does)
            if tls is not None and not _same_tls(running.tls, tls):
                keep = ("without --tls-cert/--tls-key" if running.tls is None else
                        f"with --tls-cert {running.tls[0]} --tls-key {running.tls[1]}")
                raise AttachError.tls_differs(_tls_text(running.tls), _tls_text(tls), keep,
                                              _close_call(running))
            if token_file is not None and not os.path.exists(token_file):
                write_token_file(token_file, running.address)
            return running
        kept = read_token_file(token_file) if token_file else None
        if kept is not None and host is None and port is None:
            host, port = (kept.host, kept.port)
        collector = Collector(host or LOOPBACK, port or 0,
                              token=kept.token if kept is not None else None, tls=tls)
        if token_file is not None:
            write_token_file(token_file, collector.address)
        _current = collector
        return collector


def no_jobs(how: str) -> str:
    """What to say when no job is watched; ``how``: the way to attach, as the caller's
    user types it (``%nbdist attach`` or ``nbdist.attach()``)."""
    running = current()
    if running is None:
        return f"no jobs watched ({how} first)"
    gone = ", ".join(f"job {i} ({k})" for i, k in running.detached.items())
    why = (f"{gone} detached, and no other job has reported" if gone
           else "no job has reported yet")
    return (f"no jobs watched: the collector listens, but {why}. Start a job with this line "
            f"in its environment ({how} shows how):\n  {running.line}")


def missing_job(ident: object, how: str) -> str:
    """Why no watched job is ``ident`` (its number or key), and what to do; ``how`` as in
    :func:`no_jobs`."""
    running = current()
    if running is None:
        return f"no watched job {str(ident)!r}; jobs: none ({how} first)"
    known = ", ".join(r.id for r in running.jobs.records())
    said = next((f"job {i} ({k}) was detached" for i, k in running.detached.items()
                 if str(ident) in (i, k)), None)
    if known:
        return f"no watched job {str(ident)!r}{': ' + said if said else ''}; jobs: {known}"
    why = f"{said}, and no other job is watched" if said else "no job has reported yet"
    return (f"no watched job {str(ident)!r}: {why}; start a job with this line in its "
            f"environment ({how} shows how):\n  {running.line}")
