"""Calls in flight on Dask workers, without a cluster: each call's outcome filed as its coroutine
ends, in submission order; a worker that left (or a scheduler out of reach) named in its call's
outcome, its runner released, and the wait over."""

from __future__ import annotations

import asyncio

import pytest

from nbdist.backends.dask import submission
from nbdist.backends.dask.submission import DaskSubmission

PAYLOAD = ("header", [b"frame"], "layout")


class FakeActor:
    def __init__(self, answer):
        self.answer = answer
        self.seen = None

    async def call(self, header, layout, *buffers):
        self.seen = (header, layout, buffers)
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


class FakeRunner:
    """A :class:`~nbdist.backends.dask.submission.RunnerRef`'s face: an actor, and whether it
    was made (``created`` is awaited first when not)."""

    def __init__(self, answer, created=None):
        self.actor = FakeActor(answer)
        self.ready = created is None
        self.created = created


def submit(workers, live=None, drain=list):
    forgotten: list = []
    job = DaskSubmission(list(workers), live_workers=live or (lambda: list(workers)),
                         forget=forgotten.extend, drain=drain)
    return job, forgotten


def test_outcomes_come_in_submission_order_with_values_and_the_engines_errors():
    job, forgotten = submit(["a", "b", "c"], drain=lambda: ["batch"])

    async def made():
        return None

    first = FakeRunner((True, 42), created=made())  # its actor is not made yet

    async def calls():
        await job.run(1, FakeRunner((False, "ValueError: x")), PAYLOAD)
        await job.run(0, first, PAYLOAD)
        await job.run(2, FakeRunner(OSError("connection closed")), PAYLOAD)

    assert job.pending() == ["a", "b", "c"]
    asyncio.run(calls())
    assert job.wait(0) and job.pending() == []
    assert [(o.worker, o.value, o.engine_error) for o in job.outcomes()] == [
        ("a", 42, None), ("b", None, "ValueError: x"),
        ("c", None, f"worker c: {submission._LEFT}")]
    assert first.ready and first.actor.seen == ("header", "layout", (b"frame",))
    assert job.drain_events() == ["batch"] and forgotten == []


def test_a_call_on_a_worker_that_left_ends_the_wait_and_its_runner_is_released(monkeypatch):
    monkeypatch.setattr(submission, "_LIVENESS_INTERVAL", 0.01)
    job, forgotten = submit(["a", "b"], live=lambda: ["a"])
    asyncio.run(job.run(0, FakeRunner((True, 1)), PAYLOAD))
    assert job.pending() == ["b"]
    assert job.wait(10)  # the liveness check finds b gone; its call would never end in Dask
    assert forgotten == ["b"] and job.pending() == []
    assert job.outcomes()[1].engine_error == f"worker b: {submission._LEFT}"


def test_a_scheduler_out_of_reach_ends_every_unfinished_call(monkeypatch):
    monkeypatch.setattr(submission, "_LIVENESS_INTERVAL", 0.01)

    def unreachable():
        raise OSError("Timed out trying to connect")

    job, forgotten = submit(["a", "b"], live=unreachable)
    assert job.wait(10)
    assert forgotten == ["a", "b"]
    assert {o.engine_error for o in job.outcomes()} == {
        f"worker {w}: lost contact with the scheduler: Timed out trying to connect"
        for w in "ab"}


@pytest.mark.parametrize("timeout", [0, 0.05])
def test_a_wait_for_a_live_workers_call_times_out(monkeypatch, timeout):
    monkeypatch.setattr(submission, "_LIVENESS_INTERVAL", 0.01)
    job, forgotten = submit(["a"])
    assert job.wait(timeout) is False
    assert job.pending() == ["a"] and forgotten == []
