"""The notebook's handle on the job's rendezvous store (:mod:`nbdist.runtime.boot.store_host`).

Started when a cluster starts, in parallel with the workers (it imports torch, which takes a
second or two), so it costs no start-up time. The session writes elastic plans into it; workers
read them as ``TCPStore`` clients.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
from typing import Any, Optional

from .template import popen_or_fresh


class StoreError(RuntimeError):
    """The store process failed or did not answer."""


class StoreHost:
    """A store process bound to ``host``; :meth:`port` waits until it listens."""

    def __init__(self, host: str, timeout: float) -> None:
        self.host = host
        # Forked from the cluster's worker template where it has one (torch is imported)
        self._proc = popen_or_fresh(
            [sys.executable, "-m", "nbdist.runtime.boot.store_host", host, str(timeout)],
            "the rendezvous store", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, bufsize=1)
        self._lock = threading.Lock()
        self._port: Optional[int] = None

    def port(self, timeout: float = 60.0) -> int:
        """The port the store listens on (waits for the process to say)."""
        if self._port is None:
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
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def close(self) -> None:
        proc = self._proc
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
            except (OSError, ValueError) as exc:  # ValueError: its pipe closed by close()
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
