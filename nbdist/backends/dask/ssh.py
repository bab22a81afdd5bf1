"""The Dask engine's ``ssh`` launcher: workers started over SSH, the scheduler in this process.

Dask's own ``SSHCluster`` runs the scheduler on the first host; nbdist runs it here instead,
as dask-jobqueue does, so that

* ``listen`` means what it means for every other launcher: this machine's address that the
  workers reach (loopback unless the profile says otherwise), and the scheduler and its
  dashboard bind it;
* the scheduler ends with the kernel, even after a SIGKILL, and each worker (with its nanny)
  closes as soon as its connection to the scheduler breaks: no process is left on the hosts;
* any host may be lost, the first one included, and the survivors carry on.

Workers are Dask's ``distributed.deploy.ssh.Worker`` (asyncssh; ``connect_options`` are its
keyword arguments, so ``config=[...]`` reads an OpenSSH client configuration), one process per
rank, placed as ``hosts`` says; a replacement goes to the host short of its share. The keyword
arguments are ``SSHCluster``'s (``connect_options``, ``worker_options``,
``scheduler_options``, ``worker_class``, ``remote_python``), with ``hosts`` as a mapping of
host to workers.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Mapping
from typing import Any, Optional

from distributed import Scheduler
from distributed.core import Status
from distributed.deploy.spec import SpecCluster
from distributed.deploy.ssh import Worker


class _HostWorker(Worker):
    """One worker process started over SSH; closing it never fails on a host that is gone."""

    async def close(self) -> None:
        try:
            await super().close()
        except Exception:  # the host or its connection is gone: nothing is left to stop
            self.status = Status.closed


class SSHWorkers(SpecCluster):
    """Dask workers on SSH hosts, the scheduler in this process (see the module's text)."""

    def __init__(self, hosts: Mapping[str, int], *, routes: Optional[Mapping[str, str]] = None,
                 connect_options: Optional[Mapping[str, Any]] = None,
                 worker_options: Optional[Mapping[str, Any]] = None,
                 scheduler_options: Optional[Mapping[str, Any]] = None,
                 worker_class: str = "distributed.Nanny",
                 remote_python: Optional[str] = None, listen: Optional[str] = None,
                 **kwargs: Any) -> None:
        self.hosts = {h: int(c) for h, c in hosts.items()}
        self._connect = dict(connect_options or {})
        self._worker_options = dict(worker_options or {})
        self._worker_class = worker_class
        self._python = remote_python or sys.executable
        self._routes = dict(routes or {})
        self._listen = listen
        workers = {}
        for host, count in self.hosts.items():
            for _ in range(count):
                workers[len(workers)] = self._spec(host)
        super().__init__(workers=workers,
                         scheduler={"cls": Scheduler, "options": dict(scheduler_options or {})},
                         worker=self._spec(next(iter(self.hosts))), name="nbdist-ssh",
                         **kwargs)

    def _bind(self, host: str) -> dict[str, Any]:
        """What the workers on ``host`` bind: loopback for a loopback ``listen``, every
        interface for ``"*"``, else the host's own address on the route to ``listen``."""
        from ..launchers import is_loopback

        if self._listen == "*":
            return {}
        addr = "127.0.0.1" if is_loopback(self._listen) else self._routes.get(host)
        return {"host": addr, "dashboard_address": f"{addr}:0"} if addr else {}

    def _spec(self, host: str) -> dict[str, Any]:
        return {"cls": _HostWorker, "options": {
            "address": host, "connect_options": self._connect, "worker_class": self._worker_class,
            "remote_python": self._python,
            "kwargs": {**self._bind(host), **self._worker_options}}}

    _avoid: frozenset = frozenset()  # hosts taken to be lost, while replacing their workers

    def new_worker_spec(self) -> dict[Any, dict[str, Any]]:
        """One more worker, on the host furthest below its share of ``hosts`` (of those not
        taken to be lost, while any is left)."""
        placed = Counter(spec["options"]["address"] for spec in self.worker_spec.values())
        hosts = [h for h in self.hosts if h not in self._avoid] or list(self.hosts)
        host = min(hosts, key=lambda h: (placed[h] / self.hosts[h], hosts.index(h)))
        name = max((k for k in self.worker_spec if isinstance(k, int)), default=-1) + 1
        return {name: self._spec(host)}

    def replace_lost(self, size: int) -> None:
        """Back to ``size`` workers after Dask dropped lost ones (whose nanny went with them):
        the replacements go to hosts that still have workers, a host whose workers were all
        lost being taken to be lost itself."""
        dropped = [name for name in self.worker_spec if name not in self.workers]
        host_of = {name: spec["options"]["address"] for name, spec in self.worker_spec.items()}
        alive = {host_of[n] for n in self.workers if n in host_of}
        self._avoid = frozenset(host_of[n] for n in dropped) - alive
        for name in dropped:
            del self.worker_spec[name]
        self.scale(size)
