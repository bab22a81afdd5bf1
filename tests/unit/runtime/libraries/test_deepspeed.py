"""DeepSpeed's engine in a cell reports the loss it is given: each cell's first loss at least,
however soon after the previous cell's it comes (a short training cell run again)."""

from __future__ import annotations

import sys
import types

import pytest
from synthetic import Sink

from nbdist.runtime.libraries import deepspeed as ds_module
from nbdist.runtime.measure.model import measurements
from nbdist.runtime.measure.spec import Measure

torch = pytest.importorskip("torch")


class Engine:
    """DeepSpeedEngine's two methods nbdist wraps, as DeepSpeed defines them."""

    def backward(self, loss, **kwargs):
        return loss

    def step(self, **kwargs):
        return None

    def was_step_applied(self):
        return False


@pytest.fixture
def engine_module(monkeypatch):
    module = types.ModuleType(ds_module.TRIGGER)
    module.DeepSpeedEngine = Engine
    monkeypatch.setitem(sys.modules, ds_module.TRIGGER, module)
    return module


def cell(losses):
    sink = Sink()
    measurements.begin_cell(sink, Measure(telemetry=True))
    ds_module.activate()
    try:
        engine = Engine()
        for loss in losses:
            engine.backward(torch.tensor(loss))
    finally:
        ds_module.deactivate()
        measurements.end_cell()
    return [e["values"]["loss"] for e in sink.kinds("scalars")]


def test_each_cells_first_loss_is_reported_even_right_after_the_last_cells(engine_module):
    # two cells of three quick steps, back to back (well within the 0.1 s between reads)
    assert cell([0.5, 0.25, 0.125]) == [0.5]
    assert cell([0.75, 0.375]) == [0.75]
    assert Engine.backward.__name__ == "backward" and not hasattr(Engine.backward,
                                                                  "_nbdist_original")
