"""Sphinx configuration for nbdist's documentation site.

Build it with warnings as errors (the test suite does the same, tests/integration/test_docs.py):

    python -m sphinx -W --keep-going -b html docs docs/_build/html

The pages are the Markdown files in this folder (MyST); the reference page (``reference.md``)
is plain Markdown written from the code by ``scripts/api-reference.py``, so that it reads the
same on the repository's web view.
The notebooks of ``notebooks/`` are rendered with their outputs: by default this build runs
them (a kernel that imports nbdist, a few minutes on 2 cores); with
``NBDIST_DOCS_NOTEBOOKS=DIR`` it takes already executed copies from ``DIR`` instead, as the test
suite does with the copies its notebook tests executed.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))

import nbdist  # noqa: E402

project = "nbdist"
author = "nbdist contributors"
copyright = "nbdist contributors, BSD-3-Clause"
release = version = nbdist.__version__

extensions = ["myst_nb"]
exclude_patterns = ["_build", "notebooks/scripts", "Thumbs.db", ".DS_Store"]
html_theme = "furo"
smartquotes = False  # "--all-output" must not become an en dash
html_title = f"nbdist {release}"

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
suppress_warnings = ["myst.header"]  # README-style pages start at "#"; "##" below is fine


def _stage_notebooks() -> str:
    """Copy the notebooks under ``notebooks/`` here; return myst-nb's execution mode."""
    executed = os.environ.get("NBDIST_DOCS_NOTEBOOKS")
    source = Path(executed) if executed else ROOT / "notebooks"
    target = DOCS / "notebooks"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir()
    for nb in sorted(source.glob("[0-9][0-9]-*.ipynb")):
        if not nb.name.endswith(".nbconvert.ipynb"):  # an executed copy, ignored by git
            shutil.copy2(nb, target / nb.name)
    if (ROOT / "notebooks" / "scripts").is_dir():  # the torchrun notebook runs a script
        shutil.copytree(ROOT / "notebooks" / "scripts", target / "scripts")
    return "off" if executed else "force"


def _repository_links(app, docname: str, source: list[str]) -> None:
    """Pages link files as GitHub shows them (``../notebooks/NAME.ipynb``); on the site the
    notebooks are pages under ``notebooks/``, RESULTS.md is the benchmarks page, and other
    files of the repository are named without a link."""

    def fix(m: re.Match) -> str:
        text, target = m.group(1), m.group(2)
        if target.startswith("notebooks/"):
            return f"[{text}]({target})"
        if target == "benchmarks/RESULTS.md":
            return f"[{text}](benchmarks.md)"
        return text

    if not docname.startswith("notebooks/"):
        source[0] = re.sub(r"\[([^\]]+)\]\(\.\./([^)]+)\)", fix, source[0])


def setup(app) -> None:
    app.connect("source-read", _repository_links)


nb_execution_mode = _stage_notebooks()
nb_execution_timeout = 600
nb_execution_raise_on_error = True
# Live widgets need their state and JavaScript; every nbdist display also carries static HTML
# (the run summary, the per-rank output), which a documentation page shows as it is.
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None),
                              ("html", "application/vnd.jupyter.widget-state+json", None)]
