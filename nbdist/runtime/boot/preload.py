"""Import torch and the worker runtime in a background thread as soon as a worker starts.

A worker's first call imports torch (about a second) and its warm-up builds a first DDP model,
which imports ``torch._dynamo`` (about another second, as it does under torchrun). Started at
process start-up, these imports overlap the engine's own start-up and its registration with
the controller, instead of following them. The worker's first call waits for the thread
(:func:`wait`) rather than importing the same modules beside it: two threads importing one
package's modules in different orders can deadlock on Python's import locks.

Used as ``python -m nbdist.runtime.boot.preload MODULE [ARGS...]``: start the imports, run
``MODULE`` as ``__main__`` (ipyparallel's engines, under :mod:`.lifeline`). Dask workers do
without it: a worker that its nanny restarts after a crash takes calls at once, and a
replacement's heal waits on them. Standard library only here; the imports are the thread's.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import runpy
import sys
import threading
import time
from typing import Optional

from .fork_client import fork_nanny_from_template

#: what a worker imports before it can run a training cell, slowest first
MODULES = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
           "nbdist.runtime.worker", "nbdist.runtime.group", "nbdist.runtime.measure.ddp_hooks",
           "nbdist.runtime.measure.tqdm_bars")


def _import_all() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # the call that needs it imports it again and reports the error
            return


_thread: Optional[threading.Thread] = None


def start() -> threading.Thread:
    """Start importing :data:`MODULES` in a daemon thread."""
    global _thread
    _thread = threading.Thread(target=_import_all, name="nbdist-preload", daemon=True)
    _thread.start()
    return _thread


def wait() -> None:
    """Return once the imports :func:`start` began are done (at once where none began)."""
    thread = _thread
    if thread is not None and thread is not threading.current_thread():
        thread.join()


def _complete_connection_file(args: list[str]) -> None:
    """Wait until the controller's engine connection file is complete, where an engine is told
    to wait for it (``--IPEngine.wait_for_url_file=SECONDS``).

    The engine waits only until the file exists; a controller still writing it leaves it empty
    for an instant, and an engine reading it then fails on invalid JSON.
    """
    limit = next((a.split("=", 1)[1] for a in args
                  if a.startswith("--IPEngine.wait_for_url_file=")), None)
    profile_dir = os.environ.get("IPP_PROFILE_DIR")
    if limit is None or not profile_dir:
        return
    cluster_id = os.environ.get("IPP_CLUSTER_ID")
    name = f"ipcontroller-{cluster_id}-engine.json" if cluster_id else "ipcontroller-engine.json"
    path = os.path.join(profile_dir, "security", name)
    deadline = time.monotonic() + float(limit)
    while time.monotonic() < deadline:
        try:
            with open(path, encoding="utf-8") as f:
                json.load(f)
            return
        except (OSError, ValueError):
            time.sleep(0.02)  # the controller offers nothing to wait on but the file itself


def main(argv: list[str]) -> None:
    module, *args = argv
    # A package's own imports first (ipyparallel.engine: the engine's), so the two threads
    # import disjoint modules: the engine's registration and the torch imports overlap. (A
    # plain module is not imported twice: it runs once, as __main__.)
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations is not None:
        importlib.import_module(module)
    start()
    fork_nanny_from_template()  # an engine forked from a worker template: its nanny too
    _complete_connection_file(args)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
