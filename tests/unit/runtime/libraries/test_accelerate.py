"""``accelerator.log`` in a cell reports the rank's numeric values to nbdist and still runs
Accelerate's own; between cells ``Accelerator.log`` is Accelerate's, untouched."""

from __future__ import annotations

import pytest
from synthetic import Sink

from nbdist.runtime.measure.model import measurements
from nbdist.runtime.measure.spec import Measure

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")


class Recorder(accelerate.tracking.GeneralTracker):
    """A tracker that keeps what Accelerate hands it."""

    name = "recorder"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[dict, object]] = []

    @property
    def tracker(self) -> object:
        return self

    def store_init_configuration(self, values: dict) -> None:
        pass

    def log(self, values: dict, step=None, **kwargs) -> None:
        self.logged.append((dict(values), step))


def test_accelerator_log_reports_numbers_and_still_reaches_the_trackers():
    own = accelerate.Accelerator.__dict__["log"]
    sink = Sink()
    measurements.begin_cell(sink, Measure(telemetry=True))
    try:
        recorder = Recorder()
        acc = accelerate.Accelerator(cpu=True, log_with=[recorder])
        acc.init_trackers("run")
        acc.log({"loss": torch.tensor(0.25), "lr": 0.1, "note": "warm-up"}, step=3)
    finally:
        measurements.end_cell()
    assert [e["values"] for e in sink.kinds("scalars")] == [{"loss": 0.25, "lr": 0.1}]
    assert len(recorder.logged) == 1 and recorder.logged[0][1] == 3
    assert recorder.logged[0][0]["note"] == "warm-up"
    assert accelerate.Accelerator.__dict__["log"] is own  # Accelerate's own between cells
    acc.log({"loss": 1.0})  # outside a cell: the tracker only
    assert len(sink.kinds("scalars")) == 1 and len(recorder.logged) == 2
    acc.end_training()
