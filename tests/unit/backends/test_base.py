"""The lifecycle every engine adapter inherits from ``Backend``: start, scale, stop.

Most tests use a minimal in-memory adapter, which also shows how little an engine must write;
one starts a real ipyparallel cluster that cannot come up in time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Callable, Optional

import pytest

from nbdist.backends.base import Backend, Call, Submission, WorkerId, poll_until, wait_all
from nbdist.errors import ClusterError, WorkersDidNotStart
from nbdist.telemetry.events import Batch

pytestmark = pytest.mark.timeout(120)


class _Closable:
    def __init__(self, fail: bool = False) -> None:
        self.closed, self.fail = False, fail

    def close(self) -> None:
        self.closed = True
        if self.fail:
            raise OSError("connection already gone")


class MemoryBackend(Backend):
    """Workers are integers; what an adapter must write, and no more."""

    name = "memory"
    _launchers = "memoryctl"

    def __init__(self, fail_start: bool = False, linger: int = 0) -> None:
        self.workers: list[int] = []
        self.fail_start = fail_start
        self.linger = linger  # polls a retired worker stays listed, as on a real scheduler
        self.leaving: list[int] = []

    def _start(self, n: int, timeout: float) -> None:
        self.cluster, self.client = _Closable(), _Closable()
        self.workers = list(range(n - 1 if self.fail_start else n))
        if self.fail_start:
            raise TimeoutError(f"{n - 1} of {n} workers")

    def connect(self, timeout: float, **target: Any) -> None:
        self.client, self.owns_cluster, self.workers = _Closable(), False, [0, 1]

    def worker_ids(self) -> list[WorkerId]:
        self._require()
        if self.leaving and self.linger:
            self.linger -= 1
            return [*self.workers, *self.leaving]
        return list(self.workers)

    def submit(self, calls: Sequence[Call]) -> Submission:
        raise NotImplementedError

    def interrupt(self, workers: Sequence[WorkerId]) -> None:
        pass

    def transport(self) -> Callable[[Batch], None]:
        return print

    def _grow(self, k: int, timeout: float) -> None:
        self.workers += range(len(self.workers), len(self.workers) + k)

    def _retire(self, ids: Sequence[WorkerId], timeout: float) -> None:
        self.leaving = [w for w in self.workers if w in ids]
        self.workers = [w for w in self.workers if w not in ids]

    def _add_worker(self, known: set) -> None:
        self.workers.append(max([*known, *self.workers], default=-1) + 1)


def test_an_adapter_implements_a_small_abstract_set():
    assert Backend.__abstractmethods__ == {
        "_start", "connect", "worker_ids", "submit", "interrupt", "transport"}


def test_scale_on_a_connected_cluster_is_refused_with_the_remedy():
    b = MemoryBackend()
    b.connect(5)
    with pytest.raises(ClusterError, match="not started by nbdist") as info:
        b.scale(3, 5)
    assert "memoryctl" in str(info.value) and "%nbdist restart" in str(info.value)
    assert b.worker_ids() == [0, 1]


def test_scale_before_start_says_how_to_start():
    with pytest.raises(ClusterError, match="%nbdist start --engine memory"):
        MemoryBackend().scale(3, 5)


def test_scale_grows_and_retires_the_highest_ranks_waiting_until_they_are_gone():
    b = MemoryBackend(linger=3)
    b.start(4, 5)
    b.scale(6, 5)
    assert b.worker_ids() == [0, 1, 2, 3, 4, 5]
    b.scale(2, 5)
    assert b.linger == 0  # scale returned only once the retired workers had left
    assert b.worker_ids() == [0, 1]


def test_scale_down_that_never_finishes_times_out():
    b = MemoryBackend(linger=10**6)
    b.start(3, 5)
    with pytest.raises(ClusterError, match=r"\[2\] still running after 0.2 s"):
        b.scale(2, 0.2)


def test_an_engine_error_while_scaling_keeps_its_cause():
    b = MemoryBackend()
    b.start(2, 5)
    boom = RuntimeError("no capacity")

    def fail(k: int, timeout: float) -> None:
        raise boom

    b._grow = fail  # type: ignore[method-assign]
    with pytest.raises(ClusterError, match="could not scale to 3 memory workers") as info:
        b.scale(3, 5)
    assert info.value.__cause__ is boom


def test_a_failed_start_reports_the_facts_keeps_the_cause_and_cleans_up():
    b = MemoryBackend(fail_start=True)
    with pytest.raises(WorkersDidNotStart) as info:
        b.start(3, 7)
    err = info.value
    assert (err.engine, err.ready, err.wanted, err.timeout) == ("memory", 2, 3, 7)
    assert isinstance(err.__cause__, TimeoutError) and "2 of 3 workers" in str(err)
    assert b.client is None and b.cluster is None


def test_stop_closes_the_cluster_even_when_the_client_fails_to_close(caplog):
    b = MemoryBackend()
    b.start(2, 5)
    client, cluster = _Closable(fail=True), b.cluster
    b.client = client
    with caplog.at_level(logging.DEBUG, logger="nbdist.backends.base"):
        b.stop()
    assert client.closed and cluster.closed
    assert "closing the memory client failed" in caplog.text
    b.stop()  # twice is harmless


def testpoll_until():
    calls = iter([False, False, True])
    assert poll_until(lambda: next(calls), 5, interval=0.001)
    assert not poll_until(lambda: False, 0.05, interval=0.01)


def test_poll_until_returns_the_first_true_answer_or_the_last_false_one():
    answers = iter([None, None, "SIGKILL", "later"])
    assert poll_until(lambda: next(answers), 5, interval=0.001) == "SIGKILL"
    assert poll_until(lambda: "", 0.02, interval=0.005) == ""


def test_add_worker_on_a_cluster_nbdist_did_not_start_is_refused_before_the_adapter():
    b = MemoryBackend()
    b.connect(5)
    with pytest.raises(ClusterError, match="nbdist did not start this memory cluster"):
        b.add_worker({0, 1})
    assert b.worker_ids() == [0, 1]


def test_add_worker_on_its_own_cluster_reaches_the_adapter():
    b = MemoryBackend()
    b.start(2, 5)
    b.add_worker({0, 1})
    assert b.worker_ids() == [0, 1, 2]


def test_add_worker_on_an_engine_that_cannot_says_so():
    class Fixed(MemoryBackend):
        _add_worker = Backend._add_worker

    b = Fixed()
    b.start(2, 5)
    with pytest.raises(ClusterError, match="the memory engine cannot add workers"):
        b.add_worker({0, 1})


class _Waiter:
    def __init__(self, finishes_after: Optional[float]) -> None:
        self.finishes_after, self.given = finishes_after, []

    def wait(self, timeout: Optional[float]) -> bool:
        self.given.append(timeout)
        return self.finishes_after is not None and (
            timeout is None or self.finishes_after <= timeout)


def test_wait_all_shares_one_deadline_and_stops_at_the_first_unfinished():
    done, stuck, never_asked = _Waiter(0.0), _Waiter(None), _Waiter(0.0)
    assert not wait_all([done, stuck, never_asked], 5)
    assert done.given[0] <= 5 and stuck.given[0] <= done.given[0]
    assert never_asked.given == []
    assert wait_all([_Waiter(0.0), _Waiter(0.0)], 5)


def test_wait_all_without_a_timeout_waits_without_one():
    a, b = _Waiter(1.0), _Waiter(2.0)
    assert wait_all([a, b], None)
    assert a.given == b.given == [None]


def test_a_start_that_counts_workers_as_they_come_waits_its_timeout_once(monkeypatch):
    """The start view's count and the engine's last wait share one deadline: a start told
    120 s fails after 120 s, not 240 (the count used it all; the last look is brief)."""
    import nbdist.backends.base as base

    clock = [0.0]
    monkeypatch.setattr(base.time, "monotonic", lambda: clock[0])
    waits = []

    def wait(k, timeout):  # the engine's own wait: no worker ever comes, the time passes
        waits.append(timeout)
        clock[0] += timeout
        raise TimeoutError(f"{k} engines not ready in {timeout} seconds")

    class NeverUp(MemoryBackend):
        def _start(self, n, timeout):
            self._await_workers(lambda: [], n, timeout, wait)

    b = NeverUp()
    b.on_ready = lambda k, n: None
    with pytest.raises(WorkersDidNotStart) as info:
        b.start(2, 10)
    assert waits[-1] == base._LAST_LOOK_S
    assert "2 workers not ready in 10 s" in str(info.value)
    assert clock[0] <= 10 + base._PROGRESS_STEP + base._LAST_LOOK_S
