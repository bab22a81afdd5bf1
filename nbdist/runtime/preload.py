"""Import torch and the worker runtime in a background thread as soon as a worker starts.

A worker's first call imports torch (about a second) and its warm-up builds a first DDP model,
which imports ``torch._dynamo`` (about another second, as it does under torchrun). Started at
process start-up, these imports overlap the engine's own start-up and its registration with
the controller or scheduler, instead of following them. Nothing waits for the thread: a call
that needs a module it is still importing waits on Python's import lock for that module.

Used two ways: ``python -m nbdist.runtime.preload MODULE [ARGS...]`` starts the imports and runs
``MODULE`` as ``__main__`` (ipyparallel's engines, under :mod:`.lifeline`); as a Dask worker
preload (``dask_setup``). Standard library only here; the imports are the thread's.
"""

from __future__ import annotations

import importlib
import importlib.util
import runpy
import sys
import threading

#: what a worker imports before it can run a training cell, slowest first
MODULES = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
           "nbdist.runtime.worker", "nbdist.runtime.group", "nbdist.runtime.ddp_hooks",
           "nbdist.runtime.tqdm_bars")


def _import_all() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # the call that needs it imports it again and reports the error
            return


def start() -> threading.Thread:
    """Start importing :data:`MODULES` in a daemon thread."""
    thread = threading.Thread(target=_import_all, name="nbdist-preload", daemon=True)
    thread.start()
    return thread


def dask_setup(worker: object) -> None:
    """Dask worker preload hook."""
    start()


def main(argv: list[str]) -> None:
    module, *args = argv
    # A package's own imports first (ipyparallel.engine: the engine's), so the two threads
    # import disjoint modules: the engine's registration and the torch imports overlap. (A
    # plain module is not imported twice: it runs once, as __main__.)
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations is not None:
        importlib.import_module(module)
    start()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
