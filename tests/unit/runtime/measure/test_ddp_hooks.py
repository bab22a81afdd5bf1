"""Steps of a CPU DDP model timed by DDP's own reducer timer, on the torch-free measurement
model: DDP stores a step's times at the next forward, so a step goes out once that forward
returns, with one all-reduce span; the cell's last step asks DDP to store them at once."""

from __future__ import annotations

import time

import pytest
from synthetic import Sink

from nbdist.runtime.measure.model import Measurements
from nbdist.runtime.measure.steps import DDPTimes


class ScriptedTimer:
    """Stands for DDP's timer: hands out the times of the iteration DDP last stored."""

    iterations = 0  # the hook counts syncing forwards here (forward() below does)
    nbytes = 4096
    buckets = 2

    def __init__(self) -> None:
        self.stored: DDPTimes | None = None
        self.reads: list[bool] = []  # the ``final`` flag of each read
        self.read_iterations: list[int] = []
        self.paced: list[float] = []

    def __call__(self, final: bool, iteration: int) -> DDPTimes | None:
        self.reads.append(final)
        self.read_iterations.append(iteration)
        out, self.stored = self.stored, None  # each iteration is read once
        return out

    def pace(self, step_s: float) -> None:
        self.paced.append(step_s)


def times(t0: float) -> DDPTimes:
    # compute ends at t0+0.06, the all-reduce runs from t0+0.03 to t0+0.08
    return DDPTimes(compute_end=t0 + 0.06, comm_start=t0 + 0.03, comm_end=t0 + 0.08,
                    nbytes=4096, buckets=2, dtype="float")


@pytest.fixture
def cell():
    t, timer = Measurements(), ScriptedTimer()
    t.begin_cell(Sink())
    return t, timer


def forward(t: Measurements, timer: ScriptedTimer, syncs: bool = True) -> float:
    now = time.time()
    if syncs:
        timer.iterations += 1
    t.on_forward((), timer, syncs)
    t.on_forward_end(None)
    return now


def test_a_step_goes_out_with_its_span_once_the_next_forward_stored_it(cell):
    t, timer = cell
    t0 = forward(t, timer)
    assert t.sink.kinds("step") == []  # DDP has not stored step 0's times yet
    timer.stored = times(t0)  # DDP's next forward stores them, then nbdist reads them
    forward(t, timer)
    [step0] = t.sink.kinds("step")
    [span] = t.sink.kinds("comm")
    assert span["step"] == 0 and span["measured"] == "ddp" and span["bucket"] is None
    assert (span["t0"], span["t1"], span["bytes"]) == (t0 + 0.03, t0 + 0.08, 4096)
    assert step0["comm_total_s"] == pytest.approx(0.05)
    assert step0["comm_exposed_s"] == pytest.approx(0.02)  # after compute ended
    assert step0["buckets"] == 2 and step0["comm_bytes"] == 4096
    # the cell's last step: DDP is asked to store its times now (final=True)
    sink = t.sink
    timer.stored = times(time.time())
    t.end_cell()
    assert [s["step"] for s in sink.kinds("step")] == [0, 1]
    assert timer.reads == [False, True]
    assert len(sink.kinds("comm")) == 2


def test_no_sync_micro_batches_fold_into_the_step_that_syncs(cell):
    t, timer = cell
    forward(t, timer, syncs=False)
    forward(t, timer, syncs=False)
    t0 = forward(t, timer, syncs=True)  # the one whose backward all-reduces
    assert t.sink.kinds("step") == [] and timer.reads == []
    timer.stored = times(t0)
    forward(t, timer)
    [step0] = t.sink.kinds("step")
    assert step0["step"] == 0 and step0["comm_bytes"] == 4096


def test_times_from_before_the_step_are_not_its_own(cell):
    t, timer = cell
    t0 = forward(t, timer)
    timer.stored = times(t0 - 100)  # stale: an iteration that ended before this step began
    forward(t, timer)
    [step0] = t.sink.kinds("step")
    # It synced, so its bytes are known; its all-reduce was not timed
    assert t.sink.kinds("comm") == [] and step0["comm_bytes"] == 4096
    assert step0["comm_timed"] is False and step0["comm_exposed_s"] == 0


def test_an_iteration_ddp_did_not_time_goes_out_with_its_bytes_and_no_span(cell):
    t, timer = cell
    t0 = forward(t, timer)  # iteration 1: timed
    timer.stored = times(t0)
    forward(t, timer)  # iteration 2: DDP does not time it (nothing stored)
    forward(t, timer)
    steps = t.sink.kinds("step")
    assert [(s["step"], s["comm_timed"], s["comm_bytes"], s["buckets"]) for s in steps] == [
        (0, True, 4096, 2), (1, False, 4096, 2)]
    assert [c["step"] for c in t.sink.kinds("comm")] == [0]
    assert steps[1]["bwd"] is None  # no backward span without DDP's times
    # each step asked the timer about its own iteration; only the timed one set the pace,
    # once DDP's forward had run (after it, DDP's next backward counts with the new rate)
    assert timer.read_iterations == [1, 2]
    assert timer.paced == [pytest.approx(steps[0]["t1"] - steps[0]["t0"])]



def test_through_a_real_sink_the_steps_are_built_when_the_batch_goes_out():
    """With the worker's sink, a step is handed over as it closes and its events are built
    when the batch is taken, on the sending side: the same events as built at once."""
    from nbdist.runtime.capture import EventSink
    from nbdist.telemetry.columns import unpack

    sink = EventSink(0, None, interval=3600)
    try:
        t, timer = Measurements(), ScriptedTimer()
        t.begin_cell(sink)
        plain, ptimer = Measurements(), ScriptedTimer()
        plain.begin_cell(Sink())
        for tel, tm in ((t, timer), (plain, ptimer)):
            t0 = forward(tel, tm)
            tm.stored = times(t0)
            forward(tel, tm)
            forward(tel, tm)
        assert [type(e) for e in sink._pending] == [tuple, tuple]  # handed over, not built
        batch = sink.take()
        got = list(unpack(batch["events"]))
        want = plain.sink.events
        strip = [{k: v for k, v in e.items() if k not in ("t0", "t1", "fwd", "bwd")}
                 for e in want]
        assert [{k: v for k, v in e.items() if k not in ("t0", "t1", "fwd", "bwd")}
                for e in got] == strip
        assert [e["kind"] for e in got] == ["comm", "step", "step"]
    finally:
        sink.close()


def test_a_deferred_builder_that_fails_loses_only_its_own_events(capfd):
    from nbdist.runtime.capture import EventSink
    from nbdist.telemetry import events as ev
    from nbdist.telemetry.columns import unpack

    sink = EventSink(0, None, interval=3600)
    try:
        sink.emit(ev.scalars({"a": 1.0}, 1.0, 1))
        sink.defer(lambda: 1 / 0)
        sink.defer(lambda x: [ev.scalars({"b": x}, 2.0, 2)], 2.0)
        sink.emit(ev.scalars({"c": 3.0}, 3.0, 3))
        events = list(unpack(sink.take()["events"]))
        assert [list(e["values"]) for e in events] == [["a"], ["b"], ["c"]]  # in their order
        assert "ZeroDivisionError" in capfd.readouterr().err
    finally:
        sink.close()
