"""The notebook's handle on the job's rendezvous store (:mod:`nbdist.runtime.store_host`).

The store's socket is bound here, so its port is known at once; its process (which imports
torch, a second or more of CPU) starts when :meth:`StoreHost.spawn` is called, or at the first
use. The session starts it once the first process group has formed, so that on a machine with
few cores its import does not compete with the workers' start. The session writes elastic plans
into it; workers read them as ``TCPStore`` clients (a client that connects before the process
serves waits for it).
"""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import threading
from typing import Any, Optional


class StoreError(RuntimeError):
    """The store process failed or did not answer."""


class StoreHost:
    """A store bound to ``host``: its port at once (:attr:`bound_port`), its process when
    :meth:`spawn` is called (``spawn=True``: now) or at the first use."""

    def __init__(self, host: str, timeout: float, spawn: bool = True) -> None:
        self.host = host
        self._timeout = timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock: Optional[socket.socket] = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(512)  # clients that come before the process wait in the backlog
        #: the port the store serves on, known before its process starts
        self.bound_port: int = self._sock.getsockname()[1]
        self._proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()
        self._port: Optional[int] = None
        if spawn:
            self.spawn()

    @property
    def spawned(self) -> bool:
        return self._proc is not None

    def spawn(self) -> None:
        """Start the store's process on the bound socket (once)."""
        with self._lock:
            if self._proc is not None or self._sock is None:
                return
            fd = self._sock.fileno()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "nbdist.runtime.store_host", self.host,
                 str(self._timeout), str(fd)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, bufsize=1, pass_fds=(fd,))
            self._sock.close()  # the process has its own copy; the store ends with it
            self._sock = None

    def port(self, timeout: float = 60.0) -> int:
        """The port, once the store serves on it (starts the process if need be and waits
        for it to say)."""
        if self._port is None:
            self.spawn()
            if self._proc is None:
                raise StoreError("the rendezvous store was closed")
            reply = self._read(timeout, "start")
            self._port = int(reply["port"])
        return self._port

    def set(self, key: str, value: bytes) -> None:
        self._ask({"op": "set", "key": key, "value": base64.b64encode(value).decode()})

    def get(self, key: str) -> Optional[bytes]:
        """The value at ``key``, or None while it is not set (never blocks on the key)."""
        value = self._ask({"op": "get", "key": key})
        return None if value is None else base64.b64decode(value)

    def add(self, key: str, n: int = 1) -> int:
        return int(self._ask({"op": "add", "key": key, "value": n}))

    def open(self, purpose: str) -> int:
        """Open another store in this process (e.g. a script's); return its port."""
        return int(self._ask({"op": "open", "key": purpose}))

    def close_store(self, purpose: str) -> None:
        self._ask({"op": "close", "key": purpose})

    @property
    def alive(self) -> bool:
        """The process runs, or is still to be started on a socket that is open."""
        if self._proc is None:
            return self._sock is not None
        return self._proc.poll() is None

    @property
    def pid(self) -> Optional[int]:
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:  # never started
                self._sock.close()
                self._sock = None
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                proc.stdin.close()  # the process exits at end of input
                proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait(5)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                f.close()

    def _ask(self, request: dict) -> Any:
        self.port()
        with self._lock:
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
            except OSError as exc:
                raise StoreError(f"the rendezvous store process is gone: {exc}") from exc
            reply = self._read(30.0, request["op"])
        if not reply.get("ok"):
            raise StoreError(f"rendezvous store: {reply.get('error')}")
        return reply.get("value")

    def _read(self, timeout: float, what: str) -> dict:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self._proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            err = ""
            if self._proc.poll() is not None and self._proc.stderr is not None:
                err = self._proc.stderr.read()[-2000:]
            raise StoreError(f"the rendezvous store did not answer ({what}) within {timeout:g} "
                             f"s{': ' + err if err else ''}")
        return json.loads(box[0])
