"""Steps defined by optimizer steps (FSDP2, ZeRO, plain optimizers), on the torch-free
measurement model: collectives are attributed to the step that an optimizer step closes."""

from __future__ import annotations

import pytest
from synthetic import Sink

from nbdist.runtime.measure.model import _MAX_HELD, Measurements


@pytest.fixture
def tel():
    t = Measurements()
    t.begin_cell(Sink())
    return t


def optimizer_step(t: Measurements, nested: bool = False) -> None:
    t.on_optimizer_step(begin=True)
    if nested:  # ZeRO: its inner optimizer steps inside the outer one
        t.on_optimizer_step(begin=True)
        t.on_optimizer_step(begin=False)
    t.on_optimizer_step(begin=False)


def test_collectives_belong_to_the_optimizer_step_that_follows(tel):
    sink = tel.sink
    for k in range(3):
        tel.on_collective("all_gather_single", 10.0 + k, 10.1 + k, 400, "float32", False)
        tel.on_collective("reduce_scatter_single", 10.5 + k, 10.6 + k, 400, "float32", True)
        optimizer_step(tel, nested=True)
    tel.end_cell()
    steps = sink.kinds("step")
    assert [s["step"] for s in steps] == [0, 1, 2] and all(s["source"] == "optim" for s in steps)
    comms = sink.kinds("comm")
    assert [c["step"] for c in comms] == [0, 0, 1, 1, 2, 2]
    assert steps[0]["t0"] == 10.0
    assert steps[1]["comm_exposed_s"] == pytest.approx(0.1)  # the blocking one only


def test_a_cell_without_an_optimizer_step_has_no_steps(tel):
    sink = tel.sink
    tel.on_collective("all_reduce", 1.0, 1.1, 8, "float32", True)
    tel.on_collective("all_reduce", 2.0, 2.1, 8, "float32", True)
    tel.end_cell()
    assert sink.kinds("step") == []
    assert [c["step"] for c in sink.kinds("comm")] == [None, None]
    assert tel.steps == 0


def test_a_long_collectives_loop_is_not_held_back(tel):
    sink = tel.sink
    for k in range(_MAX_HELD + 10):
        tel.on_collective("all_reduce", k, k + 0.5, 8, "float32", True)
    assert len(sink.kinds("comm")) == _MAX_HELD + 10  # sent live once it is clearly no step
    tel.end_cell()
    assert sink.kinds("step") == []


def test_an_optimizer_step_without_collectives_is_a_step(tel):
    sink = tel.sink
    optimizer_step(tel)
    optimizer_step(tel)
    tel.end_cell()
    assert [s["step"] for s in sink.kinds("step")] == [0, 1]


def test_progress_items_count_samples_of_optimizer_steps():
    t = Measurements()
    sink = Sink()
    t.begin_cell(sink)
    optimizer_step(t)  # the optimizer owns the steps from here on
    for _ in range(2):
        t.on_iteration([1, 2, 3], 0.0)  # not a tensor: counts as one sample
    optimizer_step(t)
    t.end_cell()
    steps = sink.kinds("step")
    assert len(steps) == 2 and steps[1]["samples"] == 2


def test_memory_is_sampled_after_steps_and_at_the_end():
    t = Measurements()
    sink = Sink()
    t.memory_probe = lambda: {"params": 10, "grads": 10, "optimizer": 20, "rss": 100,
                              "peak": 200, "device_peak": None}
    t.begin_cell(sink)
    optimizer_step(t)
    optimizer_step(t)  # within half a second: not sampled again
    t.end_cell()
    mems = sink.kinds("memory")
    assert len(mems) == 2 and mems[0]["optimizer"] == 20 and mems[0]["step"] == 0


def test_a_failing_memory_probe_is_dropped_not_raised(capsys):
    t = Measurements()
    sink = Sink()
    t.memory_probe = lambda: 1 / 0
    t.begin_cell(sink)
    optimizer_step(t)
    t.end_cell()
    assert sink.kinds("memory") == [] and t.memory_probe is None


def test_collectives_after_the_last_optimizer_step_are_no_step(tel):
    # FSDP2's full_tensor() after training gathers parameters: not a training step.
    sink = tel.sink
    tel.on_collective("all_gather_single", 1.0, 1.1, 400, "float32", True)
    optimizer_step(tel)
    tel.on_collective("all_gather_single", 2.0, 2.1, 400, "float32", True)
    tel.end_cell()
    assert [s["step"] for s in sink.kinds("step")] == [0]
    assert [c["step"] for c in sink.kinds("comm")] == [0, None]
    assert tel.steps == 1


def test_memory_is_sampled_at_optimizer_steps_under_ddp_too():
    t = Measurements()
    sink = Sink()
    t.memory_probe = lambda: {"params": 1, "grads": 1, "optimizer": 2, "rss": 3, "peak": 4,
                              "device_peak": None}
    t.begin_cell(sink)
    t.on_forward((None,))  # a DDP forward: DDP owns the steps
    optimizer_step(t)
    assert len(sink.kinds("memory")) == 1 and sink.kinds("step") == []
