"""The notebooks in ``notebooks/``, each executed once per test session, in the Binder environment.

A copy of the checkout (the files a fresh clone has) gets a fresh virtual environment built
the way Binder builds its image: ``binder/requirements.txt``, then ``binder/postBuild``. Its
torch comes first, installed by ``scripts/install-torch.sh`` at the version this interpreter
runs, so pip takes it from its cache or local index instead of downloading a build. The
notebooks run in a kernel of that environment (nbclient), so the Binder check, the notebooks'
own assertions, the tests on their outputs and the documentation site share one execution.

``NBDIST_NOTEBOOK_KERNEL=current`` runs them in this interpreter's kernel instead (quicker
while editing a notebook; the Binder test is then skipped, saying so).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from notebook_files import ROOT

KERNEL = "nbdist-binder"


def _files_of_a_clone(root: Path) -> list[str]:
    """Tracked files plus new files git does not ignore: what a clone of this work would hold."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=root, capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f and (root / f).is_file()]


@pytest.fixture(scope="session")
def repo_copy(tmp_path_factory) -> Path:
    """The checkout's files in a fresh directory (no build outputs, no executed notebooks)."""
    dest = tmp_path_factory.mktemp("clone") / "nbdist"
    for rel in _files_of_a_clone(ROOT):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    return dest


def _run(cmd: list[str], what: str, **kw: Any) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode:
        raise AssertionError(f"{what} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return proc.stdout


class BinderEnv:
    """A virtual environment built from ``binder/`` in a copy of the checkout."""

    def __init__(self, repo: Path, venv: Path, seconds: float):
        self.repo = repo
        self.venv = venv
        self.python = venv / "bin" / "python"
        self.seconds = seconds  # how long building it took
        self.kernels = venv.parent / "kernels"
        spec = self.kernels / KERNEL
        spec.mkdir(parents=True, exist_ok=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [str(self.python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "nbdist (Binder environment)", "language": "python"}))

    def env(self) -> dict[str, str]:
        """The kernel's environment: the venv first on PATH, nothing pointing at the checkout."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.venv)
        return env


def build_binder_env(repo: Path, venv: Path) -> BinderEnv:
    """``python -m venv`` (no system site packages), then Binder's two steps, in ``repo``."""
    import torch

    t0 = time.monotonic()
    _run([sys.executable, "-m", "venv", str(venv)], "python -m venv")
    # Bytecode is compiled on first import rather than by pip: the same environment, built in
    # a third of the time (torch alone has thousands of modules).
    env = {**BinderEnv(repo, venv, 0.0).env(), "PIP_NO_COMPILE": "1"}
    # Binder's image takes torch from requirements.txt's extra index; here the same version
    # this suite runs comes from pip's cache or local index, as scripts/install-torch.sh does.
    _run(["bash", "scripts/install-torch.sh"], "scripts/install-torch.sh", cwd=repo,
         env={**env, "PYTHON": str(venv / "bin" / "python"),
              "NBDIST_TORCH_VERSION": torch.__version__})
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-r",
          "binder/requirements.txt"], "pip install -r binder/requirements.txt", cwd=repo, env=env)
    _run(["bash", "binder/postBuild"], "binder/postBuild", cwd=repo, env=env)
    return BinderEnv(repo, venv, time.monotonic() - t0)


@pytest.fixture(scope="session")
def binder_env(repo_copy, tmp_path_factory) -> Iterator[Optional[BinderEnv]]:
    """The Binder environment (None with ``NBDIST_NOTEBOOK_KERNEL=current``)."""
    if os.environ.get("NBDIST_NOTEBOOK_KERNEL") == "current":
        yield None
        return
    env = build_binder_env(repo_copy, tmp_path_factory.mktemp("binder") / "venv")
    yield env
    shutil.rmtree(env.venv, ignore_errors=True)  # about a gigabyte; pytest keeps 3 sessions


@pytest.fixture(scope="session")
def run_notebook(repo_copy, binder_env) -> Callable[[str], Any]:
    """``run_notebook(name)``: the executed notebook (nbformat), run once per session.

    The notebook's own cells assert what it must show, so a run that did not do its job
    raises here (nbclient's CellExecutionError names the cell).
    """
    import nbclient
    import nbformat

    done: dict[str, Any] = {}  # name -> the executed notebook, or the error it raised

    def run(name: str) -> Any:
        if isinstance(done.get(name), BaseException):
            raise done[name]  # one failed run is reported by every test that reads it
        if name not in done:
            path = repo_copy / "notebooks" / name
            nb = nbformat.read(path, as_version=4)
            kw: dict[str, Any] = {}
            env = dict(os.environ, PYTHONPATH=str(repo_copy))
            if binder_env is not None:
                from jupyter_client.kernelspec import KernelSpecManager
                from jupyter_client.manager import KernelManager

                kw["km"] = KernelManager(kernel_name=KERNEL, kernel_spec_manager=(
                    KernelSpecManager(kernel_dirs=[str(binder_env.kernels)])))
                env = binder_env.env()
            client = nbclient.NotebookClient(
                nb, timeout=300, kernel_name="python3",
                resources={"metadata": {"path": str(path.parent)}}, **kw)
            t0 = time.monotonic()
            try:
                client.execute(env=env)
            except Exception as exc:
                done[name] = exc
                raise
            finally:
                km = kw.get("km")
                if km is not None and km.has_kernel:  # nbclient shuts down only kernels it made
                    km.shutdown_kernel(now=False)
            nb.metadata["nbdist_test_seconds"] = round(time.monotonic() - t0, 1)
            done[name] = nb
        return done[name]

    return run


# Two hosts in network namespaces for the multi-host tests (see nethosts.py).
from nethosts import net  # noqa: E402,F401

# A real Slurm and sshd for the launcher tests (see realclusters.py).
from realclusters import (  # noqa: E402,F401
    cluster_dirs,
    site,
    slurm,
    slurm_daemons,
    sshd,
    sshd_daemon,
)
