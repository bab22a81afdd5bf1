"""``nbdist.progress`` and ``nbdist.log`` inside a cell (:mod:`nbdist.runtime.progress`): bar
positions and values as events, each iteration a step where no DDP model counts them; plain
iteration and nothing sent outside a cell with telemetry."""

from __future__ import annotations

import pytest
from synthetic import Sink

from nbdist.runtime.measure.model import measurements
from nbdist.runtime.progress import log, progress
from nbdist.telemetry import events as ev


@pytest.fixture
def cell():
    sink = Sink()
    measurements.begin_cell(sink)
    try:
        yield sink
    finally:
        measurements.end_cell()


def test_outside_a_cell_progress_is_a_plain_iterator_and_log_does_nothing():
    assert not measurements.enabled
    bar = progress(range(3), desc="x")
    assert len(bar) == 3 and list(bar) == [0, 1, 2]
    log(loss=1.0)  # no sink to send to: nothing happens, nothing fails
    with pytest.raises(TypeError, match="update"):
        iter(progress(total=2)).__next__()
    with pytest.raises(TypeError, match="no total"):
        len(progress(iter([1])))


def test_a_bar_reports_its_start_its_end_and_each_iteration_is_a_step(cell):
    assert list(progress(range(5), desc="epoch 1")) == list(range(5))
    bars = cell.kinds(ev.PROGRESS)
    assert (bars[0]["n"], bars[0]["total"], bars[0]["desc"]) == (0, 5, "epoch 1")
    assert (bars[-1]["n"], bars[-1]["done"]) == (5, True)
    assert [b["n"] for b in bars] == sorted(b["n"] for b in bars)
    assert len({b["bar"] for b in bars}) == 1
    steps = cell.kinds(ev.STEP)
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4] and {s["samples"] for s in steps} == {1}


def test_a_bar_updated_by_hand_and_closed_by_its_context(cell):
    with progress(total=10, desc="by hand") as bar:
        bar.update(4)
        bar.update(6)  # the total reached: reported at once
    bars = [b for b in cell.kinds(ev.PROGRESS) if b["desc"] == "by hand"]
    assert [b["n"] for b in bars][-2:] == [10, 10] and bars[-1]["done"]
    assert cell.kinds(ev.STEP) == []  # update() alone is not a step


def test_log_sends_numbers_and_leaves_out_what_is_not_one(cell):
    class Scalar:  # a tensor's .item()
        def item(self):
            return 2.5

    log(step=9, loss=Scalar(), acc=0.75, note="fast", n=3)
    [values] = cell.kinds(ev.SCALARS)
    assert values["values"] == {"loss": 2.5, "acc": 0.75, "n": 3.0} and values["step"] == 9
