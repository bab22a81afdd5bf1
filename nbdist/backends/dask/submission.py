"""Calls in flight on Dask workers: each worker's runner actor as the client holds it
(:class:`RunnerRef`), and the calls of one submit (:class:`DaskSubmission`), each a coroutine on
the client's event loop that files its outcome and wakes the thread that waits. A call on a
worker that died never finishes in Dask, so a wait asks the scheduler which workers are still
alive, once a second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

import distributed
from distributed.actor import Actor

from ...runtime.packing import Packed
from ...telemetry.events import Batch
from ..base import Outcome, Submission, WorkerId
from .worker import Runner

# How often a running job asks the scheduler which workers are still alive.
_LIVENESS_INTERVAL = 1.0
_LEFT = "the worker left the cluster (its process died, or it lost the scheduler)"


class RunnerRef:
    """Client side: one worker's runner actor."""

    def __init__(self, client: distributed.Client, worker: WorkerId, created: Any):
        self.created = created  # the actor's future: kept, or Dask drops the actor
        self.ready = False  # True once the actor was made
        # Bound to nbdist's client, not to whichever Dask client is this process's default.
        with client.as_current():
            self.actor = Actor(Runner, worker, created.key)

    def release(self) -> None:
        """Let Dask forget the actor now. The handle holds a future of its own, which would
        otherwise go only when a garbage collection finds the handle."""
        self.created.release()
        own = getattr(self.actor, "_future", None)
        if own is not None:
            own.release()


class DaskSubmission(Submission):
    """Actor calls in flight; each call's coroutine on the client's event loop (:meth:`run`)
    files its outcome here and wakes :meth:`wait`.

    Made for one submit with the backend's calls it needs: ``live_workers`` (the workers the
    scheduler has now), ``forget`` (release the runners of workers found gone) and ``drain``
    (the event batches received since the last drain).
    """

    def __init__(self, workers: list[WorkerId], live_workers: Callable[[], list[str]],
                 forget: Callable[[Sequence[WorkerId]], None],
                 drain: Callable[[], list[Batch]]):
        self._workers = workers
        self._live_workers = live_workers
        self._forget = forget
        self._drain = drain
        self._done: dict[int, Outcome] = {}
        self._cond = threading.Condition()
        self._dead: dict[WorkerId, str] = {}
        self._checked = time.monotonic()  # first check after an interval: most calls are quick

    async def run(self, i: int, runner: RunnerRef, payload: Packed) -> None:
        """On the client's event loop: make the call ``i`` and file its outcome."""
        w = self._workers[i]
        try:
            if not runner.ready:  # a worker's first call waits until its runner is made
                await runner.created
                runner.ready = True
            header, buffers, layout = payload  # buffers: each a frame of Dask's own
            ok, value = await runner.actor.call(header, layout, *buffers)
            outcome = Outcome(w, value=value) if ok else Outcome(w, engine_error=value)
        except OSError:  # the scheduler's connection to the worker closed mid-call
            outcome = Outcome(w, engine_error=f"worker {w}: {_LEFT}")
        except Exception as exc:
            outcome = Outcome(w, engine_error=f"{type(exc).__name__}: {exc}")
        with self._cond:
            self._done[i] = outcome
            self._cond.notify_all()

    def _unfinished(self) -> list[WorkerId]:
        return [w for i, w in enumerate(self._workers)
                if i not in self._done and w not in self._dead]

    def _check_liveness(self) -> None:
        """A call on a worker that died never finishes in Dask (the scheduler holds it for
        that worker)."""
        now = time.monotonic()
        if now - self._checked < _LIVENESS_INTERVAL:
            return
        self._checked = now
        with self._cond:
            unfinished = self._unfinished()
        if not unfinished:
            return
        try:
            live = set(self._live_workers())
            why = _LEFT
        except Exception as exc:
            live, why = set(), f"lost contact with the scheduler: {exc}"
        gone = [w for w in unfinished if w not in live]
        with self._cond:
            for w in gone:
                self._dead[w] = why
        self._forget(gone)

    def wait(self, timeout: Optional[float]) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check_liveness()
            left = _LIVENESS_INTERVAL
            if deadline is not None:
                left = min(left, deadline - time.monotonic())
            with self._cond:
                if not self._unfinished():
                    return True
                if left <= 0:
                    return False
                self._cond.wait(left)

    def pending(self) -> list[WorkerId]:
        with self._cond:
            return self._unfinished()

    def outcomes(self) -> list[Outcome]:
        with self._cond:
            return [self._done[i] if i in self._done else
                    Outcome(w, engine_error=f"worker {w}: {self._dead.get(w, 'no answer')}")
                    for i, w in enumerate(self._workers)]

    def drain_events(self) -> list[Batch]:
        return self._drain()
