"""The documentation site builds with warnings as errors, and says what the code says.

It is built from a copy of the checkout, with the notebooks as this test session executed them
(see ``conftest.py``), so their pages show the outputs of a real run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import nbformat
import pytest
from notebook_files import NOTEBOOKS

import nbdist
from nbdist.magics import _VERBS, NbdistMagics

pytestmark = pytest.mark.timeout(900)  # the notebooks run first (shared with their tests)


@pytest.fixture(scope="module")
def site(repo_copy, run_notebook, tmp_path_factory):
    executed = tmp_path_factory.mktemp("executed")
    for name in NOTEBOOKS:
        nbformat.write(run_notebook(name), executed / name)
    html = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(repo_copy / "docs"), str(html)],
        capture_output=True, text=True, timeout=600, cwd=repo_copy,
        env=dict(os.environ, NBDIST_DOCS_NOTEBOOKS=str(executed), PYTHONPATH=str(repo_copy)))
    assert proc.returncode == 0, f"sphinx -W failed:\n{proc.stdout}\n{proc.stderr}"
    return html


def page(site, name: str) -> str:
    return (site / name).read_text(encoding="utf-8")


def test_the_site_has_the_pages_a_newcomer_needs(site):
    for name in ("index", "getting-started", "usage", "clusters", "dask", "profiles",
                 "telemetry", "strategies", "export", "fault-tolerance", "debugging",
                 "security", "faq", "reference", "benchmarks", "troubleshooting", "limits",
                 "gpu", "environment"):
        assert (site / f"{name}.html").is_file(), name
    faq = page(site, "faq.html")
    for pitfall in ("fork", "CUDA", "NCCL_DEBUG", "firewall", "daemonic"):
        assert pitfall in faq, pitfall
    bench = page(site, "benchmarks.html")
    assert "benchmarks/run_all.sh" in bench and "Summary" in bench  # RESULTS.md, included


def test_every_magic_and_option_is_in_the_reference(site):
    ref = page(site, "reference.html")
    for verb, parser in _VERBS.items():
        assert f'id="nbdist-{verb}"' in ref, verb
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"<span class=\"pre\">{option}" in ref, (verb, option)
    for action in NbdistMagics.distributed.parser._actions:
        for option in action.option_strings:
            if option not in ("-h", "--help"):
                assert option in ref, option
    assert 'id="distributed"' in ref and 'id="local"' in ref


def test_every_public_function_is_in_the_reference(site):
    ref = page(site, "reference.html")
    for name in nbdist.__all__:
        if not name.startswith("_") and name != "unload_ipython_extension":
            # Submodules (nbdist.elastic) get Sphinx's module anchor.
            assert f'id="nbdist.{name}"' in ref or f'id="module-nbdist.{name}"' in ref, name
    assert 'id="nbdist.session.Session.run_cell"' in ref
    for name in ("State", "State.commit", "State.persist", "run", "ElasticError"):
        assert f'id="nbdist.elastic.{name}"' in ref, name


def test_notebook_pages_show_the_outputs_of_the_run(site):
    for name in NOTEBOOKS:
        assert (site / "notebooks" / name.replace(".ipynb", ".html")).is_file(), name
    quick = page(site, "notebooks/00-quickstart.html")
    assert "accuracy of the pulled model on held-out data" in quick
    assert "nbdist-summary" in quick and "data:image/png" in quick  # the saved summary
    habits = page(site, "notebooks/05-auto-mode-and-output.html")
    assert "[0-1] epoch 0 done" in habits and "nbdist-rank-output-static" in habits
