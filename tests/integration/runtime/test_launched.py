"""What libraries see of their process on a rank is what they see on a torchrun rank.

The same probes (the questions Lightning, transformers, tqdm, rich and matplotlib ask to choose
between a script, a REPL and a notebook) run in a cell on each engine and in a script under a
real ``torchrun --nproc_per_node=2``; their answers must be equal, except the few named in
:data:`DIFFERENT` with the reason. The cluster starts from an environment with the variables a
Jupyter kernel sets (as it does when a notebook starts it); torchrun from the same environment
without them, as a terminal would start it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from clusters import ENGINES, start_session

pytestmark = pytest.mark.timeout(600)

#: what ipykernel and the Jupyter server put in a kernel's environment, which the processes
#: the kernel starts inherit
KERNEL_ENV = {"TERM": "xterm-color", "CLICOLOR": "1", "FORCE_COLOR": "1", "CLICOLOR_FORCE": "1",
              "PAGER": "cat", "GIT_PAGER": "cat",
              "MPLBACKEND": "module://matplotlib_inline.backend_inline",
              "JPY_PARENT_PID": "1", "JPY_SESSION_NAME": "/tmp/train.ipynb"}

PROBES = r'''
import builtins, os, sys
import __main__


def probe():
    """What libraries ask to tell a script from a REPL or a notebook, and their answers."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None

    def transformers_is_in_notebook():  # transformers.utils.import_utils.is_in_notebook
        try:
            get_ipython = sys.modules["IPython"].get_ipython
            if "IPKernelApp" not in get_ipython().config:
                raise ImportError("console")
            return True
        except (AttributeError, ImportError, KeyError):
            return False

    import tqdm.auto
    from rich.console import Console

    bar = tqdm.auto.tqdm
    console = Console()
    import matplotlib

    return {
        "sys.ps1": hasattr(sys, "ps1"),
        "sys.ps2": hasattr(sys, "ps2"),
        "sys.flags.interactive": sys.flags.interactive,
        # lightning.fabric.utilities.imports._IS_INTERACTIVE: Lightning refuses "ddp" when True
        "lightning _IS_INTERACTIVE": hasattr(sys, "ps1") or bool(sys.flags.interactive),
        "get_ipython()": type(shell).__name__ if shell is not None else None,
        "transformers is_in_notebook()": transformers_is_in_notebook(),
        "__IPYTHON__ builtin": hasattr(builtins, "__IPYTHON__"),
        "get_ipython builtin": hasattr(builtins, "get_ipython"),
        "sys.displayhook is the interpreter's": sys.displayhook is sys.__displayhook__,
        "tqdm.auto.tqdm": f"{bar.__module__}.{bar.__name__}",
        "tqdm.auto.tqdm is a notebook bar": any(c.__module__ == "tqdm.notebook"
                                                for c in bar.__mro__),
        "rich Console": [console.is_jupyter, console.is_terminal, console.color_system,
                         console.is_interactive],
        "matplotlib backend": matplotlib.get_backend(),
        "sys.stdout.isatty()": sys.stdout.isatty(),
        "environment": {k: v for k, v in os.environ.items()
                        if k in ("TERM", "CLICOLOR", "FORCE_COLOR", "CLICOLOR_FORCE", "PAGER",
                                 "GIT_PAGER", "MPLBACKEND", "NO_COLOR")
                        or k.startswith("JPY_")},
        "__main__ has __file__": hasattr(__main__, "__file__"),
        "IPython among the modules": "IPython" in sys.modules,
        "ipykernel among the modules": "ipykernel" in sys.modules,
    }
'''

TORCHRUN_MAIN = r'''
if __name__ == "__main__":
    import json
    with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
        json.dump(probe(), f)
'''

#: probes a rank answers differently from a torchrun rank, and why
DIFFERENT = {
    # Cells are not a file: a spawned child (multiprocessing's spawn, a DataLoader's workers
    # with multiprocessing_context="spawn") runs the file named there as its main.
    "__main__ has __file__": "cells are not a file",
    # An ipyparallel engine is built on IPython and ipykernel (a Dask worker imports neither).
    "IPython among the modules": "the ipyparallel engine's own",
    "ipykernel among the modules": "the ipyparallel engine's own",
}


def terminal_env() -> dict[str, str]:
    """This process's environment without a kernel's variables: a terminal's."""
    return {k: v for k, v in os.environ.items() if k not in KERNEL_ENV}


def torchrun_answers(tmp_path) -> list[dict]:
    script = tmp_path / "probe.py"
    script.write_text(PROBES + TORCHRUN_MAIN)
    out = tmp_path / "answers"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script), str(out)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=terminal_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("torchrun did not finish within 180 s")
    assert proc.returncode == 0, err[-3000:]
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def under_torchrun(tmp_path_factory) -> list[dict]:
    return torchrun_answers(tmp_path_factory.mktemp("torchrun"))


def rank_answers(engine: str, monkeypatch) -> list[dict]:
    for k, v in KERNEL_ENV.items():  # the cluster starts from a kernel's environment
        monkeypatch.setenv(k, v)
    session = start_session(engine, 2)
    try:
        session.run_cell(PROBES + "\nanswers = probe()\n", output="quiet", timeout=120)
        return [session.pull("answers", rank=r) for r in range(2)]
    finally:
        session.stop()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_rank_answers_what_a_torchrun_rank_answers(engine, monkeypatch, under_torchrun):
    ranks = rank_answers(engine, monkeypatch)
    reference = under_torchrun[0]
    assert under_torchrun[1] == reference, "torchrun's own ranks disagree"
    # What a torchrun rank answers, as ground truth: a launched process, not a REPL or notebook
    assert reference["lightning _IS_INTERACTIVE"] is False
    assert reference["get_ipython()"] is None
    assert reference["tqdm.auto.tqdm"] == "tqdm.asyncio.tqdm_asyncio"
    assert reference["__main__ has __file__"] is True
    kernel_term = reference["environment"].pop("TERM", None)
    for rank, seen in enumerate(ranks):
        # The kernel replaced the terminal's TERM: a rank started from it cannot know the
        # terminal's, and has none (a torchrun in a terminal has the terminal's)
        term = seen["environment"].pop("TERM", None)
        same = {k: v for k, v in seen.items() if k not in DIFFERENT}
        expected = {k: v for k, v in reference.items() if k not in DIFFERENT}
        assert same == expected, f"rank {rank} on {engine}"
        assert term is None, f"rank {rank} on {engine}: TERM={term} (a terminal's: {kernel_term})"
        assert seen["__main__ has __file__"] is False
        on_ipyparallel = engine == "ipyparallel"
        assert seen["ipykernel among the modules"] is on_ipyparallel
