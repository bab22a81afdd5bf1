"""``tqdm`` bars in a cell (:mod:`nbdist.runtime.measure.tqdm_bars`): progress events instead
of redraws on the worker's stderr; tqdm unchanged outside a cell with telemetry."""

from __future__ import annotations

import gc
import io
import sys
import weakref

import pytest
from synthetic import Sink

from nbdist.runtime.measure import tqdm_bars
from nbdist.runtime.measure.model import measurements
from nbdist.telemetry import events as ev


def test_a_tqdm_bar_in_a_cell_reports_progress_and_writes_nothing(monkeypatch):
    tqdm_std = pytest.importorskip("tqdm.std")
    sent = []

    class Sink:
        def emit(self, e):
            sent.append(e)

    bar_class = tqdm_bars._reporting(tqdm_std.tqdm)
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    measurements.begin_cell(Sink())
    try:
        for _ in bar_class(range(30), desc="train", mininterval=0):
            pass
    finally:
        measurements.end_cell()
    assert err.getvalue() == ""  # no "\r" redraws
    bars = [e for e in sent if e["kind"] == ev.PROGRESS]
    assert bars[0]["desc"] == "train" and bars[0]["total"] == 30
    assert bars[-1]["n"] == 30 and bars[-1]["done"]
    assert len({e["bar"] for e in bars}) == 1
    # Outside a cell with telemetry it is tqdm, unchanged.
    for _ in bar_class(range(3), file=err, mininterval=0):
        pass
    assert "\r" in err.getvalue() and "3/3" in err.getvalue()


def test_a_bar_left_mid_loop_is_freed_with_the_cells_last_reference_and_reports_its_end():
    tqdm_std = pytest.importorskip("tqdm.std")
    sink = Sink()
    collecting = gc.isenabled()
    gc.disable()  # freed by reference counting alone, as tqdm's own bar is
    try:
        freed = {}
        for name, cls, cell in (("tqdm", tqdm_std.tqdm, False),
                                ("reporting", tqdm_bars._reporting(tqdm_std.tqdm), True)):
            if cell:
                measurements.begin_cell(sink)
            bar = cls(range(10), desc="epoch", file=io.StringIO(), mininterval=0)
            for i in bar:
                if i == 3:
                    break  # the loop is left; the bar is never closed by the cell
            ref = weakref.ref(bar)
            del bar
            freed[name] = ref() is None
            if cell:
                measurements.end_cell()
    finally:
        if collecting:
            gc.enable()
    assert freed == {"tqdm": True, "reporting": True}
    last = [e for e in sink.events if e["kind"] == ev.PROGRESS][-1]
    assert last["done"] and last["n"] == 3 and last["total"] == 10  # tqdm closes it on free


def test_install_swaps_the_names_tqdm_exports_once_and_leaves_tqdm_std_alone(monkeypatch):
    tqdm = pytest.importorskip("tqdm")
    auto, std = pytest.importorskip("tqdm.auto"), pytest.importorskip("tqdm.std")
    swapped = [tqdm, auto] + [sys.modules[m] for m in ("tqdm.autonotebook", "tqdm.notebook")
                              if m in sys.modules]
    for module in swapped:
        for name in ("tqdm", "trange"):
            monkeypatch.setattr(module, name, getattr(module, name))  # put back after the test
    monkeypatch.setattr(tqdm, "_nbdist_installed", False, raising=False)
    assert tqdm_bars.install()
    installed = tqdm.tqdm
    assert installed is not std.tqdm and issubclass(installed, std.tqdm)
    assert issubclass(auto.tqdm, std.tqdm) and auto.tqdm is not installed
    assert tqdm_bars.install() and tqdm.tqdm is installed  # a second call changes nothing
    bar = tqdm.trange(3, file=io.StringIO())
    assert isinstance(bar, installed) and list(bar) == [0, 1, 2]
