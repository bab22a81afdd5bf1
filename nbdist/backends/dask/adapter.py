"""Dask engine: an embedded ``LocalCluster``, or any running Dask scheduler.

Each worker holds one nbdist runner, a Dask actor; each nbdist call is one call of that actor,
proxied through the scheduler, and runs in the worker's task thread pool, so the worker's event
loop (heartbeats, event forwarding, interrupts) stays free while a cell runs. Worker state lives
in module globals of the worker process and so persists across calls.
Events travel as Dask events: the worker logs them under a topic private to this backend and the
client is subscribed to that topic.

This module is the notebook's side; what runs inside the workers is :mod:`.worker`, the calls in
flight on their runners are :mod:`.submission`, and how clusters are launched is
:mod:`.launchers` (and :mod:`.elsewhere`).
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import logging
import os
import pickle
import re
import socket
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

import distributed
from distributed.comm.addressing import get_address_host_port
from distributed.security import Security

from ...errors import ClusterError, OptionError
from ...runtime import packing
from ...runtime.interrupt import interrupt_calls
from ...telemetry.events import Batch
from ..base import (
    Backend,
    Call,
    Submission,
    T,
    TlsIdentity,
    WorkerId,
    poll_until,
    signal_text,
)
from .elsewhere import Elsewhere, new_client
from .forkserver import dask_template_options, stop_forkserver
from .launchers import worker_process_config
from .logs import not_restart_lines, quiet_relay_errors
from .nanny import dead_words, signal_worker
from .submission import DaskSubmission, RunnerRef
from .worker import Runner, publish

# How long a connect may take to find whether anything listens at the scheduler's address.
_PROBE_TIMEOUT = 5.0
_BESIDE_TIMEOUT = 10.0  # how long a call beside a worker's busy task may take


class DaskBackend(Backend[distributed.Client]):
    """Workers are Dask workers; the channel is the scheduler's, with Dask's own security.

    A cluster that a launcher starts is an :class:`~.elsewhere.Elsewhere` of its own, which
    this backend makes for that start and closes with it."""

    name = "dask"
    _launchers = "dask-jobqueue, dask-kubernetes, ..."
    cluster: Optional[distributed.LocalCluster]

    def __init__(self) -> None:
        self._tag = f"nbdist-{uuid.uuid4().hex[:12]}"
        self._topic = f"{self._tag}-events"
        self._events: deque[bytes] = deque()
        self._runners: dict[WorkerId, RunnerRef] = {}
        self._size = 0  # workers the cluster nbdist started should have
        self._forkserver = False  # workers fork from the template (use_forkserver)
        self._elsewhere: Optional[Elsewhere] = None  # the cluster a launcher started

    # ------------------------------------------------------------------ lifecycle
    def _start(self, n: int, timeout: float) -> None:
        self._size = n
        if not self.launch.local:
            elsewhere = self._elsewhere = Elsewhere(self.name, self.launch, self._tag,
                                                    self.live_workers, self._await_dask)
            try:
                elsewhere.start(n, timeout)
            finally:  # what did start is stopped with the backend, as a local cluster is
                self.cluster, self.client = elsewhere.cluster, elsewhere.client
            return
        quiet_relay_errors()
        nanny = dask_template_options() if self.launch.template else {}
        self._forkserver = bool(nanny)
        with worker_process_config():
            # Loopback only, dashboard included; workers are spawned, or forked from the
            # worker template (a forkserver that imported torch), never from the kernel.
            # No memory limit: Dask's nanny must not kill or pause a training process.
            self.cluster = distributed.LocalCluster(
                n_workers=n, threads_per_worker=1, processes=True, host="127.0.0.1",
                dashboard_address="127.0.0.1:0", silence_logs=logging.WARNING,
                memory_limit=0, **nanny)
            self.client = new_client(self.cluster, timeout=timeout)
            self._await_dask(self.client, n, timeout)

    def _await_dask(self, client: distributed.Client, n: int, timeout: float) -> None:
        """Wait for ``n`` workers of ``client``'s scheduler, telling the start view as they
        come."""
        self._await_workers(client.nthreads, n, timeout, client.wait_for_workers)

    def start(self, n: int, timeout: float) -> None:
        super().start(n, timeout)
        self._subscribe()

    def connect(self, timeout: float, address: Any = None, scheduler_file: Optional[str] = None,
                security: Any = None, **ignored: Any) -> None:
        """Attach to a scheduler by ``address`` (or a Dask cluster object) or ``scheduler_file``.

        ``security`` is a :class:`distributed.security.Security` (TLS) for remote schedulers.
        """
        if address is None and scheduler_file is None:
            raise ClusterError("connecting to Dask needs a scheduler address "
                               "(tcp://HOST:8786) or a scheduler file")
        kwargs: dict[str, Any] = {"timeout": timeout}
        if security is not None:
            kwargs["security"] = security
        target = address if address is not None else f"scheduler file {scheduler_file}"
        _check_reachable(address, scheduler_file)
        try:
            if address is not None:
                self.client = new_client(address, **kwargs)
            else:
                self.client = new_client(scheduler_file=scheduler_file, **kwargs)
            self.client.wait_for_workers(1, timeout=timeout)
        except Exception as exc:
            self.stop()
            raise ClusterError(
                f"could not connect to the Dask scheduler at {target} with at least one worker "
                f"within {timeout:g} s: {type(exc).__name__}: {exc}. Check that the scheduler "
                "and its workers are running and reachable from here (and the TLS settings)."
            ) from exc
        self.owns_cluster = False
        self._subscribe()

    @classmethod
    def target_from_flags(cls, tls_ca_file: Optional[str] = None, tls_cert: Optional[str] = None,
                          tls_key: Optional[str] = None) -> dict[str, Any]:
        """The ``--tls-*`` flags' files as a ``security`` (a Dask ``Security`` that requires
        encryption) for :meth:`connect`.

        Raises
        ------
        OptionError
            The CA file or the certificate is not given, or a file is not there.
        """
        files = {"tls_ca_file": tls_ca_file, "tls_client_cert": tls_cert,
                 "tls_client_key": tls_key}
        if not any(files.values()):
            return {}
        if not (tls_ca_file and tls_cert):
            raise OptionError("TLS needs --tls-ca-file and --tls-cert (and --tls-key unless "
                              "the key is in the certificate file)")
        missing = [f for f in files.values() if f and not os.path.isfile(f)]
        if missing:
            raise OptionError(f"no such file: {', '.join(missing)}")
        return {"security": Security(require_encryption=True,
                                     **{k: v for k, v in files.items() if v})}

    def channel_tls(self) -> Optional[TlsIdentity]:
        """The client's certificate and key where the scheduler is reached over ``tls://``
        (the security given to :meth:`connect`, or the one a launcher's cluster made)."""
        client = self.client
        if client is None or not str(client.scheduler.address).startswith("tls://"):
            return None
        tls = client.security.get_tls_config_for_role("client")
        return TlsIdentity(tls.get("cert"), tls.get("key"))

    def _subscribe(self) -> None:
        client = self._require()
        host, _ = get_address_host_port(client.scheduler.address)
        self.controller_ip = host
        client.subscribe_topic(self._topic, self._on_event)

    def _on_event(self, event: tuple[float, Any]) -> None:
        # Runs on the client's event-loop thread; deque appends are thread-safe.
        self._events.append(event[1])

    def _drain(self) -> list[Batch]:
        out = []
        while True:
            try:
                blob = self._events.popleft()
            except IndexError:
                return out
            batch = pickle.loads(blob)
            if isinstance(batch, list):  # a node relay's: its host's batches
                out += batch
            else:
                out.append(batch)

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            if self._forkserver:  # its workers are gone: the template goes too
                self._forkserver = False
                stop_forkserver()

    def _close_cluster(self, cluster: Any) -> None:
        elsewhere, self._elsewhere = self._elsewhere, None
        if elsewhere is not None and elsewhere.cluster is cluster:
            elsewhere.close()  # its directory too
        else:
            cluster.close()

    def _close_client(self, client: distributed.Client) -> None:
        self._events.clear()
        self._runners.clear()
        try:
            client.unsubscribe_topic(self._topic)
        finally:
            client.close()

    # ------------------------------------------------------------------ workers
    def _workers_info(self) -> dict[str, Any]:
        """Every worker the scheduler knows, asked now.

        Not ``Client.scheduler_info()``: it returns a cache that the client's own periodic
        refresh may replace, between the fetch and the return, with one holding no workers.
        """
        client = self._require()
        return client.sync(client.scheduler.identity, n_workers=-1)["workers"]

    def live_workers(self) -> list[str]:
        return list(self._workers_info())

    def worker_ids(self) -> list[WorkerId]:
        info = self._workers_info()
        self._forget_runners([w for w in self._runners if w not in info])
        return sorted(info, key=lambda addr: _worker_order(addr, info[addr].get("name")))

    def submit(self, calls: Sequence[Call]) -> Submission:
        client = self._require()
        job = DaskSubmission([c.worker for c in calls], live_workers=self.live_workers,
                             forget=self._forget_runners, drain=self._drain)
        for i, c in enumerate(calls):
            payload = packing.pack((self._tag, c.fn, c.args, c.kwargs))
            client.loop.add_callback(job.run, i, self._runner(client, c.worker), payload)
        return job

    def _runner(self, client: distributed.Client, worker: WorkerId) -> RunnerRef:
        """The runner actor on ``worker``, made (not waited for) on the first call there."""
        runner = self._runners.get(worker)
        if runner is None:
            created = client.submit(Runner, actor=True, workers=[worker],
                                    allow_other_workers=False, pure=False,
                                    key=f"{self._tag}-runner-{uuid.uuid4().hex}")
            runner = self._runners[worker] = RunnerRef(client, worker, created)
        return runner

    def _forget_runners(self, workers: Sequence[WorkerId]) -> None:
        """Release the runners of workers that are gone or going (Dask would otherwise hold
        their actors' tasks for them)."""
        for w in workers:
            runner = self._runners.pop(w, None)
            if runner is not None:
                runner.release()

    def interrupt(self, workers: Sequence[WorkerId]) -> None:
        self.run_beside(workers, interrupt_calls, self._tag)

    can_restart_workers = True

    def run_beside(self, workers: Sequence[WorkerId], fn: Callable[..., T], *args: Any
                   ) -> dict[WorkerId, T]:
        """``Client.run``, on each worker's event loop (not behind the busy task), bounded: a
        loop that cannot run (a thread holding the GIL in native code) must not hold us."""
        if not workers:
            return {}
        client = self._require()
        try:  # Client.run has no time limit of its own; Client.sync gives its coroutine one
            out = client.sync(client._run, fn, *args, workers=list(workers), on_error="return",
                              callback_timeout=_BESIDE_TIMEOUT)
        except Exception:
            return {}
        return {w: v for w, v in out.items() if not isinstance(v, BaseException)}

    def restart_workers(self, ids: Sequence[WorkerId], timeout: float) -> list[WorkerId]:
        """Dask's nanny restart: each nanny kills its worker's process if it does not close in
        4 s, then starts one under the same name (the same rank). No nanny: stopped only."""
        client = self._require()
        self._forget_runners(ids)
        local = self.cluster is not None and self.launch.local  # its nannies run here
        nanny_log = logging.getLogger("distributed.nanny")
        nanny_log.addFilter(not_restart_lines)  # the cell's error says it, by rank
        try:
            with worker_process_config() if local else contextlib.nullcontext():
                status = client.restart_workers(list(ids), timeout=timeout,
                                                raise_for_error=False)
        finally:
            nanny_log.removeFilter(not_restart_lines)
        return [w for w in ids if status.get(w) == "OK"]

    def signal(self, worker: WorkerId, signum: int, pid: Optional[int] = None) -> None:
        info = self._workers_info().get(worker) or {}
        signal_worker(self._require(), worker, bool(info.get("nanny")), signum, pid)

    def _grow(self, k: int, timeout: float) -> None:
        client, cluster = self._require(), self.cluster
        assert cluster is not None  # scale() checked
        want = len(self.worker_ids()) + k
        self._size = want
        with worker_process_config(local=self.launch.local):
            cluster.scale(want)
            client.wait_for_workers(want, timeout=timeout)

    def _add_worker(self, known: set) -> None:
        cluster = self.cluster
        assert cluster is not None  # add_worker() checked
        # A nanny starts a new worker process when its worker dies: where every nanny of the
        # cluster's full size is there to do that, there is nothing to ask. Otherwise (a lost
        # nanny, or one closed while it restarted its worker) the cluster gets back to size.
        # (Not the scheduler's count plus one: right after a death it may still list the dead
        # worker, and the cluster would grow past its size.)
        size = self._size or len(self.live_workers()) + 1
        workers = getattr(cluster, "workers", {})
        restarting = [w for w in workers.values() if getattr(w, "status", None) is not None
                      and str(w.status).endswith(("running", "init", "starting"))]
        if len(restarting) >= size:
            if self._elsewhere is not None:
                self._elsewhere.replace_when_dropped(size)
            return
        with worker_process_config(local=self.launch.local):
            cluster.scale(max(size, len(getattr(cluster, "worker_spec", ()) or ())))

    def last_words(self, worker: WorkerId, host: Optional[str], pid: int) -> Optional[dict]:
        """Asked of the nannies (the dead worker's started a fresh one by now), and where no
        nanny answers for ``host``, of the workers: one on ``host`` reads the files there."""
        client = self.client
        if client is None:
            return None
        return dead_words(client, host, pid)

    def exit_cause(self, worker: WorkerId, pid: Optional[int],
                   wait: float = 1.0) -> Optional[str]:
        """Read from the nannies' logs, which note how each worker process they ran ended
        (a nanny notices within a fraction of a second; wait that long for it)."""
        client = self.client
        if pid is None or client is None:
            return None

        def logged() -> Optional[str]:
            return next((cause for lines in client.get_worker_logs(nanny=True).values()
                         for _level, line in lines if (cause := _nanny_exit(line, pid))), None)

        try:  # the nanny's log line is what we wait for; nothing signals it
            return poll_until(logged, wait)
        except Exception:  # the cluster cannot say; the death itself is the news
            return None

    def _retire(self, ids: Sequence[WorkerId], timeout: float) -> None:
        cluster = self.cluster
        assert cluster is not None  # scale() checked
        if not hasattr(cluster, "scale_down"):  # e.g. KubeCluster: it picks the workers to go
            cluster.scale(len(self.worker_ids()) - len(ids))
            return
        info = self._workers_info()
        self._size = max(0, len(info) - len(ids))
        self._forget_runners(ids)
        # Dask's own verb: it drops the workers from the cluster's spec (so they are not
        # started again) and returns once their nannies have closed. Its graceful retire
        # step passes worker names where the scheduler expects addresses, so it retires
        # nothing here and the nannies simply stop their workers; nbdist keeps no Dask data
        # on them (results are released once read), so nothing is lost.
        cluster.sync(cluster.scale_down, [info[a]["name"] for a in ids if a in info],
                     callback_timeout=timeout)

    def transport(self) -> Callable[[Union[Batch, list[Batch]]], None]:
        return functools.partial(publish, self._topic)

    def dask_client(self) -> distributed.Client:
        # nbdist's own client: its calls and the user's Dask work share the workers' pools.
        return self._require()

    def describe(self) -> str:
        if self.client is None:
            return "dask (not connected)"
        where = self.client.scheduler.address
        if self.cluster is None:
            return f"dask ({where})"
        return f"dask ({type(self.cluster).__name__} {where})"


def _check_reachable(address: Any, scheduler_file: Optional[str]) -> None:
    """Fail in seconds, with a hint, where nothing listens at the scheduler's address.

    Dask's client retries a refused connection until its timeout (300 s by default) before
    saying anything; a plain TCP connect tells at once.
    """
    if address is None and scheduler_file is not None:
        try:
            with open(scheduler_file, encoding="utf-8") as f:
                address = json.load(f)["address"]
        except (OSError, ValueError, KeyError) as exc:
            raise ClusterError(f"cannot read the Dask scheduler file {scheduler_file}: {exc}. "
                               "The scheduler writes it when started with "
                               "--scheduler-file") from exc
    if not isinstance(address, str) or not address.startswith(("tcp://", "tls://")):
        return  # a cluster object, or a transport a socket cannot probe (inproc, ucx)
    host, port = get_address_host_port(address)
    try:
        socket.create_connection((host, port), timeout=_PROBE_TIMEOUT).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ClusterError(
            f"nothing answers at {address} ({reason}). Check that the Dask scheduler is "
            "running there (it prints 'Scheduler at: tcp://HOST:PORT' when it starts) and "
            "that this machine can reach that host and port.") from exc


def _worker_order(addr: str, name: Any) -> tuple:
    """Sort key: host (numerically when an IP), then the worker's numeric name, then port.

    LocalCluster names workers 0, 1, 2, ...; ordering by name keeps existing workers' ranks
    when the cluster grows, where random ports would reshuffle them.
    """
    host, port = get_address_host_port(addr)
    try:
        host_key: tuple = (0, int(ipaddress.ip_address(host)), "")
    except ValueError:
        host_key = (1, 0, host)
    try:
        name_key: tuple = (0, int(name))
    except (TypeError, ValueError):
        name_key = (1, 0)
    return (*host_key, *name_key, port)


_NANNY_EXIT = re.compile(r"Worker process (\d+) (?:was killed by signal (\d+)|exited with "
                         r"status (-?\d+))")


def _nanny_exit(line: str, pid: int) -> Optional[str]:
    """A nanny's log line about worker process ``pid`` ending, as ``"SIGKILL"``."""
    m = _NANNY_EXIT.search(line)
    if not m or int(m.group(1)) != pid:
        return None
    if m.group(2) is not None:
        return signal_text(int(m.group(2)))
    return f"exit status {m.group(3)}"
