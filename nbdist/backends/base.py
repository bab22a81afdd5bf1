"""The small interface every engine adapter implements; the Session speaks only this."""

from __future__ import annotations

import abc
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..telemetry.events import Batch

WorkerId = Hashable


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


class Job(abc.ABC):
    """Calls in flight on several workers."""

    @abc.abstractmethod
    def wait(self, timeout: Optional[float]) -> bool:
        """Wait up to ``timeout`` seconds; True once every call has finished."""

    @abc.abstractmethod
    def pending(self) -> list[WorkerId]:
        """Workers whose call has not finished."""

    @abc.abstractmethod
    def outcomes(self) -> list[Outcome]:
        """One outcome per call, in submission order (only after :meth:`wait` is True)."""

    @abc.abstractmethod
    def drain_events(self) -> list[Batch]:
        """Event batches received since the last drain."""


class Backend(abc.ABC):
    """An engine: a set of warm worker processes that run functions and send events back."""

    name: str = "?"
    #: address workers use to reach the controller/scheduler (to find routable addresses)
    controller_ip: Optional[str] = None
    #: True when nbdist started the workers (and may scale or stop them)
    owns_cluster: bool = False

    @abc.abstractmethod
    def start(self, n: int, timeout: float) -> None:
        """Start an embedded local cluster of ``n`` workers and connect to it."""

    @abc.abstractmethod
    def connect(self, timeout: float, **target: Any) -> None:
        """Attach to an existing cluster."""

    @abc.abstractmethod
    def worker_ids(self) -> list[WorkerId]:
        """Live workers, in a stable order."""

    @abc.abstractmethod
    def submit(self, calls: Sequence[Call]) -> Job:
        """Start ``calls`` without waiting."""

    @abc.abstractmethod
    def interrupt(self, workers: Sequence[WorkerId]) -> None:
        """Raise KeyboardInterrupt in the code running on ``workers``."""

    @abc.abstractmethod
    def scale(self, n: int, timeout: float) -> None:
        """Make the cluster ``n`` workers (only where :attr:`owns_cluster`)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop what was started; disconnect from what was connected."""

    @abc.abstractmethod
    def transport(self) -> Callable[[Batch], None]:
        """A picklable function that, on a worker, sends one event batch to the notebook."""

    def describe(self) -> str:
        return self.name
