"""A library's module is activated for the cells that can use it, and only for them: where the
process has the library when a cell with telemetry starts, or the moment the cell first
imports it; deactivated when the cell ends; never with telemetry off; and the runtime never
imports a library itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator

import pytest
from synthetic import Sink

from nbdist.runtime import libraries
from nbdist.runtime.measure.model import measurements
from nbdist.runtime.measure.spec import Measure

TRIGGER = "nbdist_fake_trainlib.trainer"


@pytest.fixture
def fake(tmp_path, monkeypatch) -> Iterator[list[str]]:
    """A library on disk (``nbdist_fake_trainlib``, not imported yet) and our module for it,
    which records its activations; yields the record."""
    pkg = tmp_path / "nbdist_fake_trainlib"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "trainer.py").write_text("CALLBACKS = ['default']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls: list[str] = []
    ours = types.ModuleType("nbdist.runtime.libraries.fakelib")

    def activate() -> None:
        calls.append("activate")
        sys.modules[TRIGGER].CALLBACKS.append("ours")

    def deactivate() -> None:
        calls.append("deactivate")
        sys.modules[TRIGGER].CALLBACKS.remove("ours")

    ours.activate, ours.deactivate = activate, deactivate
    monkeypatch.setitem(sys.modules, ours.__name__, ours)
    monkeypatch.setattr(libraries, "LIBRARIES", {TRIGGER: "fakelib"})
    try:
        yield calls
    finally:
        libraries.end_cell()
        for name in ("nbdist_fake_trainlib", TRIGGER):
            sys.modules.pop(name, None)


def cell(telemetry: bool = True) -> Sink:
    sink = Sink()
    measurements.begin_cell(sink, Measure(telemetry=telemetry))
    return sink


def test_a_library_first_imported_in_a_cell_is_plugged_into_as_it_loads(fake):
    cell()
    import nbdist_fake_trainlib.trainer as trainer  # what the user's cell does

    assert trainer.CALLBACKS == ["default", "ours"]  # activated before the import returned
    assert trainer.__loader__ is trainer.__spec__.loader  # the library's own loader again
    assert type(trainer.__loader__).__name__ == "SourceFileLoader"
    measurements.end_cell()
    assert trainer.CALLBACKS == ["default"]
    assert fake == ["activate", "deactivate"]
    assert libraries._watch not in sys.meta_path  # between cells, imports are left alone


def test_a_library_the_process_has_is_plugged_into_at_the_cells_start(fake):
    import nbdist_fake_trainlib.trainer as trainer

    for _ in range(2):  # the training cell run again
        cell()
        assert trainer.CALLBACKS == ["default", "ours"]
        measurements.end_cell()
        assert trainer.CALLBACKS == ["default"]
    assert fake == ["activate", "deactivate"] * 2


def test_with_telemetry_off_nothing_is_plugged_in(fake):
    cell(telemetry=False)
    import nbdist_fake_trainlib.trainer as trainer

    assert trainer.CALLBACKS == ["default"]
    measurements.end_cell()
    assert fake == []


def test_a_module_that_fails_to_plug_in_costs_a_line_not_the_import(fake, monkeypatch, capfd):
    def broken() -> None:
        raise AttributeError("CALLBACKS moved")

    monkeypatch.setattr(sys.modules["nbdist.runtime.libraries.fakelib"], "activate", broken)
    cell()
    import nbdist_fake_trainlib.trainer as trainer

    assert trainer.CALLBACKS == ["default"]
    measurements.end_cell()
    err = capfd.readouterr().err
    assert "nbdist: could not plug into nbdist_fake_trainlib" in err
    assert "CALLBACKS moved" in err and "will not show in the dashboard" in err


def test_the_runtime_imports_no_library_itself():
    code = textwrap.dedent("""
        import sys
        import nbdist.runtime.worker, nbdist.runtime.libraries
        from nbdist.runtime.measure.model import measurements
        class Sink:
            def emit(self, e): pass
        measurements.begin_cell(Sink())
        measurements.end_cell()
        print(sorted(m for m in ("transformers", "accelerate", "lightning", "deepspeed")
                     if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"
