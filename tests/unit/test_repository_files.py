"""Files a newcomer meets first: notebooks stored without outputs, listed and linked, Binder's
set-up and the install extras that keep a fresh clone free of skips and warnings."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# not the executed copies nbconvert writes beside a notebook (git ignores them)
NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb")
                   if not p.name.endswith(".nbconvert.ipynb"))

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_stored_without_outputs(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    assert re.fullmatch(r"\d\d-[a-z0-9-]+\.ipynb", path.name), "numbered, lower-case names"
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, cell["source"][:1]
    first = "".join(nb["cells"][0]["source"])
    assert first.startswith("# "), "each notebook opens with a title"
    # ... and says first what it needs: extras, CPU or GPU, how long it runs
    needs = first.split("\n\n")[1]
    assert needs.startswith("**Needs:** `pip install -e \".[notebook"), needs
    assert "CPU" in needs and re.search(r"about\s\d+ s on 2 cores", needs), needs


def test_every_notebook_is_listed_in_the_readme_and_the_badge_opens_one():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for path in NOTEBOOKS:
        assert f"(notebooks/{path.name})" in readme, path.name
    [badge] = re.findall(r"mybinder\.org/v2/gh/[^)]*labpath=([^)&]+)", readme)
    assert (ROOT / badge.replace("%2F", "/")).is_file()


def test_extras_install_what_the_suite_and_the_notebooks_need():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]

    def names(extra):
        return {re.split(r"[<>=!~\[ ]", req)[0].lower() for req in extras[extra]}

    assert {"cryptography", "numpy", "tqdm", "sphinx", "myst-nb"} <= names("test")
    assert {"numpy", "tqdm", "ipykernel", "ipywidgets", "pandas"} <= names("notebook")
    assert {"transformers", "accelerate", "lightning"} <= names("libraries") <= names("test")
    assert ".[notebook,dask,libraries]" in (ROOT / "binder" / "postBuild").read_text()
    assert ".[notebook]" in (ROOT / "scripts" / "quickstart.sh").read_text()


def test_each_launcher_extra_named_in_errors_installs_the_launchers_package():
    from nbdist.backends.dask.launchers import _EXTRAS, cluster_spec
    from nbdist.options import LaunchOptions

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for launcher, extra in _EXTRAS.items():
        package = cluster_spec(LaunchOptions(launcher=launcher, listen="*"), 1)[2]
        names = {re.split(r"[<>=!~\[ ;]", req)[0].lower() for req in extras[extra]}
        assert {package, "distributed"} <= names, (launcher, extra)
    # the suite's install covers the launchers the real-cluster tests start
    assert ".[test,slurm,ssh]" in (ROOT / "scripts" / "test.sh").read_text()
