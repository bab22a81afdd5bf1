"""A rank looks like a launched process to the libraries cells use, not a REPL nor a notebook.

Libraries ask their process how it runs and choose their behaviour from the answer: Lightning
refuses ``strategy="ddp"`` where ``sys.ps1`` exists or ``sys.flags.interactive`` is set,
transformers and ``tqdm.auto`` draw notebook widgets where ``get_ipython().config`` holds
``IPKernelApp``, rich and click colour their output where ``FORCE_COLOR`` or
``CLICOLOR_FORCE`` is set, matplotlib draws for an inline backend named by ``MPLBACKEND``.
An ipyparallel engine is an IPython kernel: it answers "a notebook" to all of these, and both
engines' workers inherit the variables a Jupyter kernel sets for its own display when the
kernel starts them. Under torchrun a rank answers "a launched process"; so does a rank here:

* :func:`launch_env` says which of the kernel's variables a rank drops (or takes back from
  its process's start environment), applied when the worker joins the job and undone when it
  leaves;
* :func:`launched` hides, for the time of a cell, the REPL's prompts (``sys.ps1``, ``ps2``,
  ``ps3``), IPython's shell (``get_ipython()`` is None), the ``__IPYTHON__`` builtin and the
  kernel's ``sys.displayhook``; the engine gets them back between cells, where it runs its own
  requests. nbdist's own use of the engine's shell (its event channel) goes through
  :func:`shell`, which finds it while it is hidden.

What still differs from a torchrun rank, by design: ``__main__`` has no ``__file__`` (cells are
not a file: a spawned child would run the file named there as its main), and an ipyparallel
engine has ``IPython`` and ``ipykernel`` among its modules (it is built on them).

Stdlib only; IPython is never imported here, only looked up where the process already has it.
"""

from __future__ import annotations

import builtins
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Optional

#: variables a Jupyter kernel (ipykernel, the server) sets for its own display, with the values
#: it sets: a rank drops them where they hold those values
KERNEL_VALUES: dict[str, tuple[str, ...]] = {
    "TERM": ("xterm-color",),
    "CLICOLOR": ("1",),
    "FORCE_COLOR": ("1",),
    "CLICOLOR_FORCE": ("1",),
    "PAGER": ("cat",),
    "GIT_PAGER": ("cat",),
    "PYDEVD_USE_FRAME_EVAL": ("NO",),  # ipykernel's debugger
}
#: matplotlib backends that draw into a notebook (``MPLBACKEND`` set by ipykernel, or ipympl)
NOTEBOOK_BACKENDS = ("module://matplotlib_inline.", "module://ipympl.", "inline", "widget",
                     "ipympl", "nbagg")
#: prefixes of variables only a Jupyter server's kernels have (``JPY_PARENT_PID``,
#: ``JPY_SESSION_NAME``: the notebook's path, which some libraries read as "in a notebook")
KERNEL_PREFIXES = ("JPY_",)
#: the REPL's prompts, which IPython sets so that "scripts can decide if they run interactively"
PROMPTS = ("ps1", "ps2", "ps3")


def is_kernels(name: str, value: str) -> bool:
    """Whether ``name=value`` is one a Jupyter kernel sets for its own display.

    >>> is_kernels("FORCE_COLOR", "1"), is_kernels("FORCE_COLOR", "0"), is_kernels("JPY_X", "")
    (True, False, True)
    """
    if name.startswith(KERNEL_PREFIXES):
        return True
    if name == "MPLBACKEND":
        return value.lower().startswith(NOTEBOOK_BACKENDS)
    return value in KERNEL_VALUES.get(name, ())


def start_environment() -> dict[str, str]:
    """The environment this process was started with (Linux's ``/proc/self/environ``), before
    the kernel it may run changed its own; empty where the platform does not say."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            env[name.decode(errors="replace")] = value.decode(errors="replace")
    return env


def launch_env(environ: Mapping[str, str],
               started: Mapping[str, str]) -> dict[str, Optional[str]]:
    """What a rank changes in ``environ`` to have the environment of a launched process: each
    kernel variable (:func:`is_kernels`) goes back to its value in ``started`` (the process's
    start environment) where that one is not the kernel's, else is removed (None).

    >>> launch_env({"TERM": "xterm-color", "FORCE_COLOR": "1", "HOME": "/h"},
    ...            {"TERM": "xterm-256color", "FORCE_COLOR": "1"})
    {'TERM': 'xterm-256color', 'FORCE_COLOR': None}
    """
    changes: dict[str, Optional[str]] = {}
    for name, value in environ.items():
        if is_kernels(name, value):
            before = started.get(name)
            changes[name] = before if before is not None and not is_kernels(name, before) \
                else None
    return changes


_hidden: dict[type, Any] = {}  # the shell's classes -> their instance, while it is hidden


def shell() -> Any:
    """This process's IPython shell (an ipyparallel engine's), hidden from a cell or not; None
    where the process has none."""
    for value in _hidden.values():
        return value
    module = sys.modules.get("IPython.core.interactiveshell")
    return getattr(module.InteractiveShell, "_instance", None) if module is not None else None


def _hide_shell() -> None:
    """``get_ipython()`` answers None: IPython's singleton is unset on every class of the shell
    (traitlets keeps it on each), to be put back by :func:`_show_shell`."""
    instance = shell()
    if instance is None or _hidden:
        return
    for cls in type(instance).__mro__:
        if vars(cls).get("_instance") is instance:
            _hidden[cls] = instance
            cls._instance = None  # type: ignore[attr-defined]


def _show_shell() -> None:
    for cls, instance in list(_hidden.items()):
        cls._instance = instance  # type: ignore[attr-defined]
    _hidden.clear()


_MISSING = object()


@contextmanager
def launched() -> Iterator[None]:
    """For a cell's time: no REPL prompts, no IPython shell, no ``__IPYTHON__`` builtin, the
    interpreter's own ``sys.displayhook``; everything is put back when the cell ends."""
    prompts = {name: getattr(sys, name) for name in PROMPTS if hasattr(sys, name)}
    for name in prompts:
        delattr(sys, name)
    marker = vars(builtins).pop("__IPYTHON__", _MISSING)
    hook = sys.displayhook
    sys.displayhook = sys.__displayhook__
    _hide_shell()
    try:
        yield
    finally:
        _show_shell()
        sys.displayhook = hook
        if marker is not _MISSING:
            vars(builtins)["__IPYTHON__"] = marker
        for name, value in prompts.items():
            setattr(sys, name, value)
