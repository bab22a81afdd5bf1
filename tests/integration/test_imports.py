"""Import boundaries, checked in fresh interpreters."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def modules_after(code: str) -> set[str]:
    script = code + "\nimport sys\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=100, check=True).stdout
    return set(out.split())


def test_worker_runtime_needs_no_notebook_stack():
    mods = modules_after("import nbdist.runtime.worker, nbdist.runtime.measure.ddp_hooks\n"
                         "nbdist.runtime.measure.ddp_hooks.install()")
    assert "torch" in mods
    for banned in ("IPython", "ipywidgets", "zmq", "ipyparallel", "nbdist.display",
                   "nbdist.session"):
        assert banned not in mods, f"{banned} imported by the worker runtime"


def test_import_nbdist_is_cheap():
    mods = modules_after("import nbdist\nnbdist.progress, nbdist.log")
    for banned in ("torch", "ipywidgets", "ipyparallel", "distributed"):
        assert banned not in mods, f"`import nbdist` imported {banned}"


def test_the_engine_registry_and_the_workers_halves_import_no_adapter():
    # Workers import their engine's half through nbdist.backends, which registers the engines.
    from nbdist.backends import registry

    halves = "\n".join(f"import {e.worker}" for e in registry.engines())
    mods = modules_after(halves)
    for e in registry.engines():
        assert e.worker in mods
        assert e.adapter.partition(":")[0] not in mods, f"{e.worker} imported its adapter"


def test_measurement_model_and_user_api_are_torch_free():
    # The notebook imports both (nbdist.progress); only ddp_hooks may load torch.
    mods = modules_after("import nbdist.runtime.measure.model, nbdist.runtime.progress")
    for banned in ("torch", "nbdist.runtime.measure.ddp_hooks", "nbdist.telemetry.aggregate"):
        assert banned not in mods, f"the measurement model imported {banned}"


def test_display_never_imports_engines_or_runtime():
    mods = modules_after("import nbdist.display, nbdist.display.widgets, nbdist.display.html")
    for banned in ("nbdist.backends", "nbdist.runtime", "nbdist.session", "torch"):
        assert banned not in mods, f"nbdist.display imported {banned}"


def test_views_fall_back_to_text_without_ipywidgets():
    code = """
import sys
sys.modules["ipywidgets"] = None   # as if it were not installed
from nbdist.display import display_medium, make_cluster_view, make_run_view
from nbdist.display.text import TextDashboard
from nbdist.telemetry import events as ev
assert display_medium("widget") == "text"
view = make_run_view("rank0", 0, 2, mode="widget")
assert isinstance(view.dashboard, TextDashboard)
from nbdist.telemetry.run import Run
run = Run("cell", [0, 1], world_size=2)
batches = [{"rank": 0, "seq": 1, "events": [ev.progress(1, "train", 3, 10, 1.0),
                                            ev.end(True, 2.0)]}]
view.output(batches)
run.feed(batches)
view.refresh(run.snapshot)
run.finish()
view.close(run.snapshot())
assert make_cluster_view(lambda: "STATUS", mode="widget") == "STATUS"
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0, out.stderr
    assert "train 3/10" in out.stdout
