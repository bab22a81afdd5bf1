"""Binder, checked: ``binder/`` builds an environment in which every notebook runs.

repo2docker itself does not run here; its two steps for this repository do, in a fresh
virtual environment without the system's packages (see ``conftest.py``).
"""

from __future__ import annotations

import subprocess

import pytest
from notebook_files import NOTEBOOKS, outputs_text

pytestmark = pytest.mark.timeout(900)


def test_binder_environment_runs_every_notebook(binder_env, run_notebook, record_property):
    if binder_env is None:
        pytest.skip("NBDIST_NOTEBOOK_KERNEL=current: the notebooks ran in this interpreter")
    cfg = (binder_env.venv / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg
    probe = subprocess.run(
        [str(binder_env.python), "-c",
         "import distributed, ipykernel, ipywidgets, numpy, torch, tqdm, nbdist; "
         "print(nbdist.__file__)"],
        capture_output=True, text=True, env=binder_env.env(), timeout=120,
        cwd=binder_env.venv.parent)  # not the checkout, whose nbdist/ a -c script would see
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.startswith(str(binder_env.repo))  # the clone's nbdist, not the checkout
    assert "NumPy" not in probe.stderr  # torch's "Failed to initialize NumPy" warning
    seconds = {}
    for name in NOTEBOOKS:
        nb = run_notebook(name)  # raises if a cell failed, asserts included
        seconds[name] = nb.metadata["nbdist_test_seconds"]
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert "Failed to initialize NumPy" not in outputs_text(cell), name
    record_property("binder_env_seconds", round(binder_env.seconds, 1))
    record_property("notebook_seconds", seconds)
    print(f"Binder environment built in {binder_env.seconds:.0f} s; notebooks: {seconds}")
