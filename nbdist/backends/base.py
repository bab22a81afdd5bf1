"""The small interface every engine adapter implements; the Session speaks only this."""

from __future__ import annotations

import abc
import logging
import os
import signal
import time
from collections.abc import Hashable, Iterable, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Callable, Generic, NamedTuple, Optional, Protocol, TypeVar, Union

from ..errors import (
    ClusterError,
    LaunchFailed,
    MissingPackageError,
    OptionError,
    UnguardedScriptError,
    WorkersDidNotStart,
)
from ..options import LaunchOptions
from ..telemetry.events import Batch

WorkerId = Hashable
ClientT = TypeVar("ClientT")
T = TypeVar("T")

logger = logging.getLogger(__name__)

#: how long one of the engine's waits for the next worker lasts while the start view counts
_PROGRESS_STEP = 0.2
#: the engine's last wait when the count already used the whole timeout: long enough for its
#: own answer (which says why not), short enough not to add to the timeout
_LAST_LOOK_S = 0.5


@dataclass
class Call:
    """One function call on one worker."""

    worker: WorkerId
    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: Optional[dict] = None


@dataclass
class Outcome:
    """What came back from one :class:`Call`: a value, or the engine's own error text."""

    worker: WorkerId
    value: Any = None
    engine_error: Optional[str] = None


class Submission(abc.ABC):
    """Calls in flight on several workers."""

    @abc.abstractmethod
    def wait(self, timeout: Optional[float]) -> bool:
        """Wait up to ``timeout`` seconds; True once every call has finished."""

    @abc.abstractmethod
    def pending(self) -> list[WorkerId]:
        """Workers whose call has not finished."""

    @abc.abstractmethod
    def outcomes(self) -> list[Outcome]:
        """One outcome per call, in submission order. Each call's outcome is final once it
        has returned; while others run, only the outcomes of calls not :meth:`pending` mean
        anything (the cell loop reads those, to show a rank's end at once)."""

    @abc.abstractmethod
    def drain_events(self) -> list[Batch]:
        """Event batches received since the last drain."""


class TlsIdentity(NamedTuple):
    """The certificate and key the notebook's client presents on an engine's TLS channel,
    each as PEM text or a file's path (None where the engine has none)."""

    cert: Optional[str] = None
    key: Optional[str] = None


class WorkerGone(LookupError):
    """A call was addressed to a worker the engine no longer has."""

    def __init__(self, workers: Sequence[WorkerId]):
        self.workers = list(workers)
        super().__init__(f"no such worker(s): {self.workers}")


class Backend(abc.ABC, Generic[ClientT]):
    """An engine: a set of warm worker processes that run functions and send events back.

    **Adding an engine is one folder and one registration.** ``nbdist/backends/NAME/`` holds
    the adapter (``adapter.py``: a subclass of this class, as below) and the half its workers
    import (``worker.py``, which must not import the adapter); ``nbdist/backends/__init__.py``
    registers it with the facts the rest of nbdist asks before the adapter is imported::

        register(Engine(name="ray", adapter="nbdist.backends.ray.adapter:RayBackend",
                        package="ray", extra="ray", worker="nbdist.backends.ray.worker",
                        launchers=("local", "kubernetes")))

    From that line (:class:`~nbdist.backends.registry.Engine`) the option records, profiles
    and the magics accept the name and its launchers, :func:`~nbdist.backends.get_backend`
    imports the adapter on the first start or connect (naming ``extra`` when ``package`` is
    missing), the check before an SSH start reaches the hosts with its ``ssh_client`` and
    looks for its ``package`` there, its ``connect_flags`` join ``%nbdist connect``, and the
    integration suites run it (``tests/clusters.py``). Nothing outside ``backends/`` compares
    an engine's name; a package outside nbdist registers the same way, before the engine is
    first named.

    To implement an adapter you provide

    1.  ``name``, the engine's short name as registered, and ``_launchers``, the tools that
        start its clusters (named in the remedy when a cluster nbdist did not start is
        scaled);
    2.  ``_start(n, timeout)``: start a cluster of ``n`` workers (on this machine, or through
        the engine's launcher that :attr:`launch` names), set :attr:`cluster`,
        :attr:`client` (whatever object talks to the engine; ``None`` means "not connected")
        and :attr:`controller_ip`, and wait for the workers;
    3.  ``connect(timeout, **target)``: attach to a running cluster, set :attr:`client`,
        :attr:`controller_ip` and ``owns_cluster = False``;
    4.  ``worker_ids``, ``submit`` (returning your :class:`Submission`), ``interrupt`` and
        ``transport``;
    5.  optionally ``_close_client`` / ``_close_cluster`` when ``.close()`` is not how the
        engine lets go of them, ``describe``, and ``dask_client`` where the workers can also
        be Dask workers;
    6.  optionally, only for engines that can scale, ``_grow(k, timeout)`` (add ``k``
        workers and wait for them), ``_retire(ids, timeout)`` (stop those workers) and
        ``_add_worker(known)`` (start one more without waiting for it);
    7.  optionally, where one worker's process can be replaced, ``restart_workers`` and
        ``can_restart_workers = True`` (ranks an interrupt cannot stop are then restarted), and
        ``run_beside`` where a busy worker still answers;
    8.  optionally, where the registration declares ``connect_flags``,
        :meth:`target_from_flags`: their values made into :meth:`connect`'s keywords
        (Dask's ``--tls-*`` files into a ``security``);
    9.  optionally, where the engine can reach a cluster over TLS, :meth:`channel_tls`: the
        client's certificate and key while it does (push and pull then go under TLS too).

    In return you get

    1.  :meth:`start`: ownership recorded; on failure what was started is stopped and the
        error is :class:`~nbdist.errors.WorkersDidNotStart`, with the engine's own error
        as its ``__cause__`` and the number of workers that did come up (a missing package,
        a :class:`~nbdist.errors.LaunchFailed` or a bad option is raised as it is: its
        reason is the news);
    2.  :meth:`scale`: refused with the remedy on a cluster nbdist did not start; retires the
        highest ranks, so the ranks that stay keep their numbers; waits until the retired
        workers are gone; engine errors become :class:`~nbdist.errors.ClusterError`;
    3.  :meth:`stop`: client, then cluster, each released even when the other fails;
    4.  :meth:`add_worker`: refused, with the reason, on a cluster nbdist did not start;
    5.  :meth:`_require`: the connected client, or a ClusterError that says what to type.
    """

    name: str = "?"
    #: tools that start this engine's clusters, for the remedy when scaling one is refused
    _launchers: str = "..."
    #: address workers use to reach the controller/scheduler (to find routable addresses)
    controller_ip: Optional[str] = None
    #: True when nbdist started the workers (and may scale or stop them)
    owns_cluster: bool = False
    #: the engine's client; ``None`` while not connected
    client: Optional[ClientT] = None
    #: the cluster nbdist started, if it did
    cluster: Any = None
    #: where :meth:`start` starts workers: this machine, or a launcher of the engine (set by
    #: the session before it calls :meth:`start`; adapters read it in ``_start``)
    launch: LaunchOptions = LaunchOptions()
    #: told ``(ready, wanted)`` as workers come up while :meth:`start` waits for them (the
    #: session's view of a start); None: nobody is told
    on_ready: Optional[Callable[[int, int], None]] = None
    #: :meth:`restart_workers` can replace one worker's process (for ranks an interrupt
    #: cannot stop)
    can_restart_workers: bool = False

    # ------------------------------------------------------------------ what adapters provide
    @abc.abstractmethod
    def _start(self, n: int, timeout: float) -> None:
        """Start a local cluster of ``n`` workers, connect to it and wait for the workers."""

    @abc.abstractmethod
    def connect(self, timeout: float, **target: Any) -> None:
        """Attach to an existing cluster."""

    @abc.abstractmethod
    def worker_ids(self) -> list[WorkerId]:
        """Live workers, in a stable order."""

    @abc.abstractmethod
    def submit(self, calls: Sequence[Call]) -> Submission:
        """Start ``calls`` without waiting; raise :class:`WorkerGone` for a worker the engine
        no longer has."""

    @abc.abstractmethod
    def interrupt(self, workers: Sequence[WorkerId]) -> None:
        """Raise KeyboardInterrupt in the code running on ``workers``."""

    @abc.abstractmethod
    def transport(self) -> Callable[[Union[Batch, list[Batch]]], None]:
        """A picklable function that, on a worker, sends one event batch to the notebook, or a
        list of them as one message (a node relay's, :mod:`nbdist.runtime.node_relay`)."""

    @classmethod
    def target_from_flags(cls, **given: Any) -> dict[str, Any]:
        """The keywords of :meth:`connect` that the engine's own ``%nbdist connect`` flags
        (its registration's ``connect_flags``) make: ``given`` maps each flag given to its
        value. Called before anything is stopped or started; this one hands them on as they
        are.

        Raises
        ------
        OptionError
            The values do not make a target (engines that check them).
        """
        return dict(given)

    def describe(self) -> str:
        return self.name

    def channel_tls(self) -> Optional[TlsIdentity]:
        """Whether the engine's own channel to this cluster is TLS, and with which client
        identity: None where it is not (the notebook's data channel is then plain TCP too);
        engines that can reach a cluster over TLS say so."""
        return None

    def dask_client(self) -> Any:
        """A ``distributed.Client`` whose workers are these workers (engines that can)."""
        raise ClusterError(f"the {self.name} engine cannot serve Dask work")

    def _grow(self, k: int, timeout: float) -> None:
        """Add ``k`` workers and wait until they are up (engines that can scale)."""
        raise ClusterError(f"the {self.name} engine cannot add workers")

    def _retire(self, ids: Sequence[WorkerId], timeout: float) -> None:
        """Stop the workers ``ids``; :meth:`scale` then waits until they are gone."""
        raise ClusterError(f"the {self.name} engine cannot remove workers")

    def _add_worker(self, known: set) -> None:
        """Start one more worker without waiting for it (engines that can); see
        :meth:`add_worker`."""
        raise ClusterError(f"the {self.name} engine cannot add workers")

    def signal(self, worker: WorkerId, signum: int, pid: Optional[int] = None) -> None:
        """Send ``signum`` to ``worker``'s process from outside it (``%nbdist kill``), even
        while it runs a cell; ``pid`` is the process's id as the worker reported it."""
        raise ClusterError(f"the {self.name} engine cannot signal a worker")

    def restart_workers(self, ids: Sequence[WorkerId], timeout: float) -> list[WorkerId]:
        """Replace the processes of workers ``ids`` with fresh ones that take the same place
        in :meth:`worker_ids` (engines with :attr:`can_restart_workers`); returns the workers
        replaced (the others were stopped only)."""
        raise ClusterError(f"the {self.name} engine cannot restart one worker")

    def run_beside(self, workers: Sequence[WorkerId], fn: Callable[..., T], *args: Any
                   ) -> dict[WorkerId, T]:
        """``fn(*args)`` on each of ``workers`` beside the call it is busy with, by worker;
        ``{}`` where the engine cannot reach a busy worker (or it does not answer soon)."""
        return {}

    def last_words(self, worker: WorkerId, host: Optional[str], pid: int) -> Optional[dict]:
        """What dead worker process ``pid`` left on ``host``, another host than the
        notebook's (:func:`~nbdist.runtime.last_words.last_words`: its last lines on stderr
        and its record of the cell line), read and removed there; None where the engine
        cannot run a call on that host."""
        return None

    def exit_cause(self, worker: WorkerId, pid: Optional[int]) -> Optional[str]:
        """How a worker process ended (``"SIGKILL"``, ``"exit status 1"``), where the engine
        knows; None otherwise."""
        return None

    @staticmethod
    def child_exit(pid: Optional[int]) -> Optional[str]:
        """How a child of this process ended, read without reaping it (its launcher still
        will), or None when it is not our child, still runs or was reaped already."""
        if pid is None or not hasattr(os, "waitid"):
            return None
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except (ChildProcessError, OSError):
            return None
        if info is None:
            return None
        if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
            return signal_text(info.si_status)
        return f"exit status {info.si_status}"

    def _close_client(self, client: ClientT) -> None:
        client.close()  # type: ignore[attr-defined]

    def _close_cluster(self, cluster: Any) -> None:
        cluster.close()

    # ------------------------------------------------------------------ what adapters get
    def _await_workers(self, ready: Callable[[], Sized], n: int, timeout: float,
                       wait: Callable[..., Any]) -> None:
        """Tell :attr:`on_ready` how many of ``n`` workers are up (``len(ready())``) as they
        come, until all are or ``timeout`` passes; then the engine's own
        ``wait(n, ...)`` for the time left, which says why not: ``timeout`` bounds the whole.
        Without :attr:`on_ready`, the engine's own wait alone. Adapters call it in
        ``_start``."""
        if self.on_ready is None:
            wait(n, timeout=timeout)
            return
        deadline, last = time.monotonic() + timeout, -1
        while True:
            try:
                k = len(ready())
            except Exception:  # the engine cannot say yet: its own wait will
                k = max(last, 0)
            if k != last:
                self.on_ready(min(k, n), n)
                last = k
            if k >= n or time.monotonic() > deadline:
                break
            try:  # the engine's own wait for one more: it returns as that one comes up
                wait(k + 1, timeout=_PROGRESS_STEP)
            except TimeoutError:
                pass
        # The time left, not a second ``timeout``: a start told 120 s would otherwise wait 240
        left = deadline - time.monotonic()
        try:
            wait(n, timeout=max(left, min(_LAST_LOOK_S, timeout)))
        except TimeoutError as exc:
            if left >= _LAST_LOOK_S:
                raise
            # the engine's own words would name the last look's half second, not the timeout
            raise TimeoutError(f"{n} workers not ready in {timeout:g} s") from exc

    def start(self, n: int, timeout: float) -> None:
        """Start an embedded local cluster of ``n`` workers and connect to it."""
        self.owns_cluster = True
        try:
            self._start(n, timeout)
        except (MissingPackageError, LaunchFailed, OptionError, UnguardedScriptError):
            self.stop()  # the reason is the news (a package, a host, an option), not a count
            raise
        except Exception as exc:
            ready = self._count_started()
            try:
                self.stop()
            except Exception:  # the start failure is the news; the cleanup's is logged
                logger.warning("could not stop the partly started %s cluster", self.name,
                               exc_info=True)
            raise WorkersDidNotStart(self.name, ready, n, timeout, _reason(exc)) from exc

    def add_worker(self, known: set) -> None:
        """Start one more worker without waiting for it (elastic training's replacement); it
        shows up in :meth:`worker_ids` as an id not in ``known``. Only where the cluster is
        nbdist's own."""
        if not self.owns_cluster or self.cluster is None:
            raise ClusterError(f"nbdist did not start this {self.name} cluster, so it cannot "
                               "add a worker to it")
        self._add_worker(known)

    def scale(self, n: int, timeout: float,
              order: Optional[Sequence[WorkerId]] = None) -> None:
        """Make the cluster ``n`` workers (only where :attr:`owns_cluster`); ``order`` lists
        its workers in rank order (default: :meth:`worker_ids`'s), the last ones leave first."""
        self._require()
        if not self.owns_cluster or self.cluster is None:
            raise ClusterError(
                f"this {self.name} cluster was not started by nbdist: scale it with the tool "
                f"that started it ({self._launchers}), then run %nbdist restart")
        ids = list(order) if order is not None else self.worker_ids()
        try:
            if n > len(ids):
                self._grow(n - len(ids), timeout)
            elif n < len(ids):
                gone = set(ids[n:])  # the highest ranks: the ranks that stay keep their numbers
                self._retire(ids[n:], timeout)
                if not poll_until(lambda: not gone & set(self.worker_ids()), timeout):
                    raise ClusterError(f"could not scale to {n} {self.name} workers: "
                                       f"{ids[n:]} still running after {timeout:g} s")
        except ClusterError:
            raise
        except Exception as exc:
            raise ClusterError(f"could not scale to {n} {self.name} workers within "
                               f"{timeout:g} s ({_reason(exc)})") from exc

    def stop(self) -> None:
        """Stop what was started; disconnect from what was connected.

        A client that fails to close is logged and dropped (the other end may already be
        gone); a cluster that fails to stop raises, since its processes may still run.
        """
        client, self.client = self.client, None
        cluster, self.cluster = self.cluster, None
        if client is not None:
            try:
                self._close_client(client)
            except Exception:
                logger.debug("closing the %s client failed", self.name, exc_info=True)
        if cluster is not None:
            self._close_cluster(cluster)

    def _require(self) -> ClientT:
        """The connected client, or a ClusterError that says how to get one."""
        if self.client is None:
            raise ClusterError(f"no {self.name} cluster: run %nbdist start --engine "
                               f"{self.name} or %nbdist connect --engine {self.name}")
        return self.client

    def _count_started(self) -> int:
        """How many workers are up, for the report of a failed start (0 when unknown)."""
        try:
            return len(self.worker_ids())
        except Exception:
            return 0


def poll_until(predicate: Callable[[], T], timeout: float, interval: float = 0.05) -> T:
    """Wait until ``predicate()`` answers something true, and return that answer; once
    ``timeout`` seconds pass, return its last (false) answer.

    For state the engine changes in the background and offers nothing to wait on, such as a
    worker leaving the scheduler's or controller's list, or a log line saying how a process
    ended; the cost is one call of ``predicate`` per ``interval``.
    """
    deadline = time.monotonic() + timeout
    while True:
        answer = predicate()
        if answer or time.monotonic() >= deadline:
            return answer
        time.sleep(interval)


class Waitable(Protocol):
    """Anything with ``wait(timeout) -> bool``: a :class:`Submission`, or an engine's async
    result."""

    def wait(self, timeout: Optional[float]) -> bool: ...


def wait_all(pending: Iterable[Waitable], timeout: Optional[float]) -> bool:
    """Wait for each of ``pending`` in turn (jobs, or an engine's own async results), all
    within one ``timeout`` (None: no limit); True once every one has finished."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for one in pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not one.wait(left):
            return False
    return True


def _reason(exc: BaseException) -> str:
    """``Type: message``, or the type alone for an exception without a message."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def signal_text(number: int) -> str:
    """``9`` -> ``"SIGKILL"``."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
