"""ipyparallel engine: an embedded local cluster, or any cluster ipyparallel's launchers reach."""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Sequence
from concurrent import futures
from functools import partial
from typing import Any, Callable, Optional, Union
from urllib.parse import urlparse

import ipyparallel as ipp
from ipyparallel.serialize import PrePickled

from ...boot.template import Template, active, set_active
from ...errors import ClusterError, LaunchFailed, MissingPackageError
from ...telemetry.events import Batch
from ..base import Backend, Call, Outcome, Submission, WorkerGone, WorkerId, poll_until, signal_text
from ..remote import (
    Host,
    check_ssh_hosts,
    failure_text,
    log_tails,
    make_cluster_dir,
    remove_cluster_dir,
    remove_remotely,
    ssh_command,
)
from .launchers import launcher_settings
from .template import TemplateEngineSetLauncher, start_template
from .worker import KEY, ByName, publish

# How long the nanny of an engine may take to say it sent a signal.
_SIGNAL_REPLY_S = 10.0
# The controller confirms a new engine only once it has answered a heart beat: it sees the
# answer to one ping at the next, so an engine waits one to two periods after it registers.
# ipyparallel's default period (3 s) makes a local start wait that long; at 100 ms a start or a
# replacement is confirmed within 0.2 s. More misses allowed keep the same 10 s tolerance for
# an engine that stops answering (a ping is a few bytes; the controller's loop stays idle).
_HEARTBEAT_ARGS = ["--HeartMonitor.period=100", "--HeartMonitor.max_heartmonitor_misses=100"]
# The controller drops an engine's registration when its heart has not beaten within
# IPController.registration_timeout (30 s by default): an engine starts its heart only after
# its nanny and kernel, and one slower than that is ignored for good, its process running on
# and never counted ("only 2 of 3 workers started" after any timeout). The registration is
# held for as long as nbdist may wait for it: the start's timeout, and at least this long for
# the engines a scale or a healing adds later.
_REGISTRATION_S = 300
# How long a failed start asks the engines that did register for their pids (to name the
# processes that did not).
_PIDS_S = 2.0


def _returncode_text(code: Optional[int]) -> Optional[str]:
    if code is None:
        return None
    if code < 0:
        return signal_text(-code)
    return f"exit status {code}"


class _KilledEngineLog(logging.Filter):
    """Hides the engine log ipyparallel shows for an engine that a signal killed.

    ipyparallel warns with the tail of an engine's own log (its registration lines) whenever
    an engine exits non-zero. For an engine killed by a signal (SIGKILL, the OOM killer),
    nbdist already names the rank, host, pid and signal, in the cell's error or in elastic
    training's healing line; the engine's log would push that out of sight. An engine that
    exited with a status of its own keeps ipyparallel's warning. The record names the engine
    only by its index within its engine set, so an index shared with a killed engine of an
    earlier set is hidden too.
    """

    def __init__(self, cluster: ipp.Cluster) -> None:
        super().__init__()
        self.cluster = cluster

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith("Output for %s")
                and isinstance(record.args, tuple) and record.args):
            return True
        return not any(
            getattr(launcher, "identifier", None) == record.args[0]
            and ((getattr(launcher, "stop_data", None) or {}).get("exit_code") or 0) < 0
            for engine_set in list(self.cluster.engines.values())
            for launcher in list(getattr(engine_set, "launchers", {}).values()))


def _launcher_exit(launcher: Any) -> Optional[str]:
    """How a local engine's process ended, as its launcher's waiting thread saw it.

    That thread reaps the process and passes the status to the cluster's event loop, which
    runs only while nbdist calls into the cluster; until then the status is on the thread's
    process object (and a second wait on a reaped child would read nothing).
    """
    code = (getattr(launcher, "stop_data", None) or {}).get("exit_code")
    if code is None:  # an engine forked from the template: the template reported it
        code = getattr(launcher, "exit_code", None)
    if code is None:
        code = getattr(getattr(launcher, "process", None), "_exitcode", None)
    return _returncode_text(code) if isinstance(code, int) else None


def _log_end(launcher: Any, lines: int = 3) -> str:
    """``", its log ends: ..."`` with the last lines of a local engine's output file."""
    try:
        with open(launcher.output_file, encoding="utf-8", errors="replace") as f:
            tail = [line.rstrip() for line in f.readlines()[-lines:] if line.strip()]
    except (AttributeError, OSError):
        return ""
    return ", its log ends: " + " | ".join(tail) if tail else ""


class _IppSubmission(Submission):
    """One reply future per worker (the children of ipyparallel's AsyncResults: one apply
    to several engines has one each)."""

    def __init__(self, client: ipp.Client, results: list[tuple[WorkerId, Any]]):
        self._client = client
        self._results = results

    def wait(self, timeout: Optional[float]) -> bool:
        _, pending = futures.wait([f for _, f in self._results], timeout)
        return not pending

    def pending(self) -> list[WorkerId]:
        return [w for w, f in self._results if not f.done()]

    def outcomes(self) -> list[Outcome]:
        out = []
        for w, f in self._results:
            try:  # the reply's value, or the exception ipyparallel made of it
                value = f.result(0)
            except Exception as e:  # noqa: BLE001 - a future that failed outright
                value = e
            if isinstance(value, ipp.error.RemoteError):
                out.append(Outcome(w, engine_error=f"{value.ename}: {value.evalue}\n"
                                                   f"{value.traceback or ''}"))
            elif isinstance(value, Exception):  # engine died, or unregistered mid-call
                out.append(Outcome(w, engine_error=f"{type(value).__name__}: {value}"))
            else:
                out.append(Outcome(w, value=value))
        return out

    def drain_events(self) -> list[Batch]:
        batches = []
        for _, f in self._results:
            # The live dict the client's IO thread updates (the AsyncResult's public metadata
            # parses every timestamp in it with dateutil on each read).
            data = f.output.metadata["data"]
            for key in [k for k in list(data) if k.startswith(KEY)]:
                batches.append(data.pop(key))
        return batches


class IpyparallelBackend(Backend[ipp.Client]):
    """Workers are ipyparallel engines; their channel is authenticated by the cluster's key."""

    name = "ipyparallel"
    _launchers = "ipcluster, Slurm, ..."
    cluster: Optional[ipp.Cluster]

    _engine_kwargs: dict[str, Any] = {}
    _timeout: float = 300.0
    _dask: Any = None  # the distributed.Client of become_dask, once asked for
    #: the worker template this cluster's engines fork from (None: fresh processes)
    template: Optional[Template] = None
    _dask_engines: frozenset = frozenset()
    _dir: Optional[str] = None  # the cluster's own directory (launchers other than local)
    _hosts: list[Host] = []  # the SSH hosts as the check before the start found them
    _ssh: list[str] = []  # the ssh command with its arguments
    _started = False  # True once every worker came up (a failed start keeps its files)

    def _start(self, n: int, timeout: float) -> None:
        self._timeout = timeout
        # A local controller and engines listen on loopback only (the connection files carry
        # the key); with a launcher that starts engines elsewhere, on the address the profile
        # names.
        ip = "127.0.0.1" if self.launch.local else self.launch.listen
        where: dict[str, Any] = {}
        python = None
        if not self.launch.local:
            # Its own profile: connection files, job scripts and logs, out of the notebook's
            # directory and the user's ~/.ipython.
            self._dir = where["profile_dir"] = make_cluster_dir(self.name)
            for name in ("ipython_config.py", "ipython_kernel_config.py"):
                # Hosts sharing this filesystem find the profile complete: ipyparallel's
                # `ipython profile create` there then prints nothing into the notebook.
                open(os.path.join(self._dir, name), "a").close()
            if self.launch.launcher == "ssh":  # before anything starts there
                self._hosts, python = check_ssh_hosts(self.launch, self.name, self._dir)
                self._ssh = ssh_command(self.launch)
        cluster_kwargs, self._engine_kwargs = launcher_settings(self.launch, timeout,
                                                                self._dir, python)
        if self.launch.local and self.launch.template:
            # Engines (and the rendezvous store) fork from a process that imports torch now
            self.template = start_template()
        if self.template is not None:
            set_active(self.template)
            cluster_kwargs["engine_launcher_class"] = TemplateEngineSetLauncher
            self._engine_kwargs = {**self._engine_kwargs, "template": self.template}
        hold = ("--IPController.registration_timeout="  # whole seconds; an endless start's too
                f"{max(math.ceil(min(timeout, 10**9)), _REGISTRATION_S)}")
        self.cluster = ipp.Cluster(n=n, controller_ip=ip, log_level=logging.WARNING,
                                   controller_args=[*_HEARTBEAT_ARGS, hold], **where,
                                   **cluster_kwargs)
        self.cluster.log.addFilter(_KilledEngineLog(self.cluster))
        if self.template is not None:
            # The controller starts while the template imports; the engines fork once it is
            # done, and are registered a moment later.
            self.cluster.start_controller_sync()
            self.cluster.start_engines_sync(n, **self._engine_kwargs)
        elif self.launch.local:
            # Engines first: they start, and import torch, while the controller starts; each
            # waits for the controller's connection file (IPEngine.wait_for_url_file) instead
            # of being launched only once the controller has written it.
            self.cluster.start_engines_sync(n, **self._engine_kwargs)
            self.cluster.start_controller_sync()
        else:  # engines elsewhere are handed the controller's connection info when they start
            try:
                self.cluster.start_controller_sync()
                self.cluster.start_engines_sync(n, **self._engine_kwargs)
            except Exception as exc:  # a command failed: more time would not help
                raise LaunchFailed(
                    f"ipyparallel's {self.launch.launcher!r} launcher could not start the "
                    f"engines: {failure_text(exc)}. What did start was stopped; the cluster's "
                    f"files are in {self._dir}") from exc
        self._engine_launchers()
        self.client = self.cluster.connect_client_sync()
        if self.launch.local:
            # No progress bar of ipyparallel's: the session shows "k of n ready" its own way.
            try:
                self._await_workers(lambda: self.client.ids, n, timeout,
                                    partial(self.client.wait_for_engines, interactive=False))
            except TimeoutError as exc:
                detail = self._unregistered()
                raise TimeoutError(f"{exc}; {detail}" if detail else str(exc)) from exc
        else:
            self._wait_elsewhere(n, timeout)
        self.controller_ip = "127.0.0.1" if self.launch.local else _registration_host(
            self.client)
        self._started = True

    def _wait_elsewhere(self, n: int, timeout: float) -> None:
        """Wait for engines started elsewhere; fail as soon as too many have exited to make
        ``n`` (SSH engines: their launchers watch each process), with their logs' ends."""
        client = self._require()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if self.on_ready is not None:
                self.on_ready(min(len(client.ids), n), n)
            try:
                client.wait_for_engines(n, timeout=max(0.1, min(1.0, left)),
                                        interactive=False)
                return
            except TimeoutError as exc:
                running = self._engines_to_come()
                if len(client.ids) + running < n:
                    raise LaunchFailed(
                        f"{n - len(client.ids) - running} of the {n} engines exited "
                        f"before they registered with the controller; "
                        f"{log_tails(self._dir or '')}") from exc
                if left <= 1.0:
                    raise ClusterError(f"{exc}; {log_tails(self._dir or '')}") from exc

    def connect(self, timeout: float, **target: Any) -> None:
        self._timeout = timeout
        kwargs = {k: v for k, v in target.items() if v is not None}
        if "ipp_profile" in kwargs:  # nbdist's name: `profile` is start's profile file
            kwargs["profile"] = kwargs.pop("ipp_profile")
        # ipyparallel 9 takes the connection file positionally; its url_file= is ignored.
        connection_info = kwargs.pop("url_file", None)
        try:
            self.client = ipp.Client(connection_info, timeout=timeout, **kwargs)
            self.client.wait_for_engines(1, timeout=timeout, interactive=False)
        except Exception as exc:
            raise ClusterError(
                f"could not connect to the ipyparallel cluster {kwargs or '(default profile)'}: "
                f"{exc}. Check that `ipcluster start` is running and the connection file is "
                "readable here."
            ) from exc
        self.owns_cluster = False
        self.controller_ip = _registration_host(self.client)

    def worker_ids(self) -> list[WorkerId]:
        return sorted(self._require().ids)

    def submit(self, calls: Sequence[Call]) -> Submission:
        client = self._require()
        gone = sorted({c.worker for c in calls} - set(client.ids))
        if gone:  # ipyparallel itself would raise a bare IndexError ("No such engine")
            raise WorkerGone(gone)
        results = []
        for group in _same_calls(calls):
            c, targets = group[0], [g.worker for g in group]
            results.extend(zip(targets, _apply(client, targets, *_pack(c))))
        return _IppSubmission(client, results)

    def interrupt(self, workers: Sequence[WorkerId]) -> None:
        if workers:
            self._require().send_signal(signal.SIGINT, targets=list(workers), block=False)

    def signal(self, worker: WorkerId, signum: int, pid: Optional[int] = None) -> None:
        # The engine's nanny, a process beside it, sends the signal: it arrives while a cell
        # runs in the engine, and needs no access to its host from here.
        future = self._require().send_signal(signum, targets=[worker], block=False)
        try:
            [reply] = future.result(timeout=_SIGNAL_REPLY_S)
            why = None if reply["content"].get("status") == "ok" else reply["content"]
        except Exception as exc:  # no answer: no nanny relays signals for this engine
            why = f"{type(exc).__name__}: {exc}"
        if why is not None:
            raise ClusterError(f"could not signal engine {worker} ({why}); an engine started "
                               "with --IPEngine.enable_nanny=False cannot be signalled from "
                               "outside")

    def _grow(self, k: int, timeout: float) -> None:
        client, cluster = self._require(), self.cluster
        assert cluster is not None  # scale() checked
        want = len(client.ids) + k
        cluster.start_engines_sync(k, **self._engine_kwargs)
        self._engine_launchers()
        client.wait_for_engines(want, timeout=timeout, interactive=False)

    def _add_worker(self, known: set) -> None:
        assert self.cluster is not None  # add_worker() checked
        self.cluster.start_engines_sync(1, **self._engine_kwargs)
        self._engine_launchers()

    def _engines_to_come(self) -> int:
        """Engines whose process still runs (SSH: each has a launcher that watches it), or may
        still start (a batch job: nothing here watches it in the queue, so all its engines)."""
        count = 0
        for engine_set in list(getattr(self.cluster, "engines", {}).values()):
            if not hasattr(engine_set, "launchers") and engine_set.state == "running":
                count += engine_set.n
        return count + len([la for la in self._engine_launchers()
                            if getattr(la, "state", "running") == "running" and getattr(
                                getattr(la, "_wait_thread", None), "is_alive", lambda: True)()])

    def _unregistered(self) -> str:
        """The local engine processes that have not registered, each with how it stands
        (running, or how it ended) and its log's last lines: for the error of a start that
        timed out. Empty where the engines that did register cannot say their pids."""
        client = self._require()
        try:
            pids = set(client[:].apply_async(os.getpid).get(timeout=_PIDS_S)) \
                if client.ids else set()
        except Exception:  # noqa: BLE001 - the start's own error is the news
            return ""
        parts = []
        for launcher in self._engine_launchers():
            pid = getattr(launcher, "pid", None)
            if pid in pids:
                continue
            how = _launcher_exit(launcher) or "still running, not registered"
            parts.append(f"engine process {pid}: {how}{_log_end(launcher)}")
        return "; ".join(parts)

    def _engine_launchers(self) -> list[Any]:
        """Every engine launcher this backend has seen, ended ones included: where the
        cluster's event loop runs (in a notebook kernel), an engine set drops a launcher as
        soon as its process ends, taking the exit status with it."""
        seen = self.__dict__.setdefault("_seen_launchers", {})
        for engine_set in list(getattr(self.cluster, "engines", {}).values()):
            for launcher in list(getattr(engine_set, "launchers", {}).values()):
                seen[id(launcher)] = launcher
        return list(seen.values())

    def exit_cause(self, worker: WorkerId, pid: Optional[int],
                   wait: float = 0.5) -> Optional[str]:
        if self.cluster is None or pid is None:
            return None
        launchers = [la for la in self._engine_launchers() if getattr(la, "pid", None) == pid]
        if not launchers:
            return None  # an engine started elsewhere: its launcher is not here to ask
        # The launcher's thread reaps the process within moments; nothing signals it.
        return poll_until(lambda: _launcher_exit(launchers[0]) or self.child_exit(pid), wait,
                          interval=0.02)

    def _retire(self, ids: Sequence[WorkerId], timeout: float) -> None:
        # Returns once the engines were told; they leave client.ids at their unregistration.
        self._require().shutdown(targets=list(ids), block=True)

    def _close_cluster(self, cluster: ipp.Cluster) -> None:
        # Engines stopped on purpose exit non-zero; ipyparallel would log that as a warning.
        cluster.log.setLevel(logging.ERROR)
        # nbdist stops it here, or says why it could not: ipyparallel's own try at exit
        # would only repeat the failure later.
        cluster.shutdown_atexit = False
        if self.launch.local:
            cluster.stop_cluster_sync()
            return
        try:
            _stop_remote(cluster)
        finally:
            if self._hosts and self._dir:
                remove_remotely(self._hosts, self._dir, self._ssh)
            if self._started:
                remove_cluster_dir(self._dir)

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            template, self.template = self.template, None
            if template is not None:  # after its engines: they are its children
                if active() is template:
                    set_active(None)
                template.close()

    def transport(self) -> Callable[[Union[Batch, list[Batch]]], None]:
        return publish

    def dask_client(self) -> Any:
        """The engines as Dask workers too, through ipyparallel's ``become_dask``.

        The scheduler runs in the controller and binds the controller's address (loopback for
        a local cluster); each engine hosts one worker thread. Engines added by a scale get
        theirs at the next call.
        """
        client = self._require()
        engines = frozenset(client.ids)
        if self._dask is not None and engines == self._dask_engines:
            return self._dask
        try:
            import distributed  # noqa: F401  (become_dask needs it on both ends)
        except ImportError:
            raise MissingPackageError("nbdist.dask_client() on ipyparallel", "distributed") \
                from None
        host = self.controller_ip or "127.0.0.1"
        worker_args: dict[str, Any] = {"memory_limit": 0}  # no pausing by Dask's heuristics
        if self.owns_cluster and self.launch.local:
            worker_args["host"] = "127.0.0.1"
        old, self._dask = self._dask, client.become_dask(
            scheduler_args={"host": host, "dashboard_address": f"{host}:0"}, **worker_args)
        self._dask_engines = engines
        # The engines start their workers asynchronously: hand over the client once they are in.
        self._dask.wait_for_workers(len(engines), timeout=self._timeout)
        if old is not None:
            old.close()
        return self._dask

    def _close_client(self, client: ipp.Client) -> None:
        dask, self._dask = self._dask, None
        if dask is not None:
            dask.close()
            if not self.owns_cluster:  # someone else's engines stay: stop their Dask workers
                client.stop_dask()
        client.close()

    def describe(self) -> str:
        if self.cluster is not None:
            where = "local" if self.launch.local else self.launch.launcher
            return f"ipyparallel ({where} cluster {self.cluster.cluster_id})"
        return "ipyparallel (connected)"


def _stop_remote(cluster: ipp.Cluster) -> None:
    """Stop the controller and the engines that did start (an engine whose launch failed has
    nothing to stop, and asking ipyparallel to stop it fails)."""
    for engine_set in list(cluster.engines.values()):
        launchers = getattr(engine_set, "launchers", None)
        if isinstance(launchers, dict):
            for key, launcher in list(launchers.items()):
                if getattr(launcher, "state", "running") != "running":
                    launchers.pop(key)
    cluster.stop_cluster_sync()


def _pack(c: Call) -> tuple[Any, list[Any], dict[str, Any]]:
    """``c`` packed for ipyparallel's apply: the call with its arguments as one pickle where
    pickle takes them (:meth:`ByName.bind`), else each argument canned as ipyparallel cans it
    (a lambda or a closure among them travels as its code)."""
    fn, args, kwargs = ByName.bind(c.fn, c.args, c.kwargs or {})
    if isinstance(fn, ByName) and (fn.args or fn.kwargs):
        try:
            return PrePickled(fn), [], {}
        except Exception:  # noqa: BLE001 - pickle refused an argument: send them one by one
            fn, args, kwargs = ByName.of(c.fn), tuple(c.args), dict(c.kwargs or {})
    return (PrePickled(fn), [PrePickled(a) for a in args],
            {k: PrePickled(v) for k, v in kwargs.items()})


def _apply(client: ipp.Client, targets: list[WorkerId], pf: Any, pargs: list[Any],
           pkwargs: dict[str, Any]) -> list[Any]:
    """Send a packed call (:func:`_pack`) to each of ``targets``; one reply future each.

    What a DirectView's apply does (the call packed once, one message per engine, through the
    controller's queue), without the view's bookkeeping: its history, its outstanding set and
    an AsyncResult over the replies cost a cell about 0.2 ms of the notebook's CPU."""
    send = getattr(client, "send_apply_request", None)
    stream = getattr(client, "_mux_stream", None)
    if send is None or stream is None:  # an ipyparallel without them: through a view
        return list(client[targets].apply_async(pf, *pargs, **pkwargs)._children)
    idents, _ = client._build_targets(targets)
    return [send(stream, pf, pargs, pkwargs, metadata={"label": None}, ident=ident)
            for ident in idents]


def _same_calls(calls: Sequence[Call]) -> list[list[Call]]:
    """Runs of consecutive calls of the same function with the same arguments (the same
    objects: the session builds one call for every rank where they do not differ)."""
    groups: list[list[Call]] = []
    for c in calls:
        last = groups[-1][0] if groups else None
        if (last is not None and c.fn is last.fn and c.args is last.args
                and c.kwargs is last.kwargs):
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


def _registration_host(client: ipp.Client) -> Optional[str]:
    """The controller's address as the client reached it (workers reach it there too)."""
    url = getattr(client, "_config", {}).get("registration") or ""
    return urlparse(url).hostname

