"""What training libraries log becomes the rank's telemetry, with no nbdist line in the code.

People train with Hugging Face's ``Trainer``, Accelerate or Lightning rather than a loop of
their own: those libraries log values (the loss, the learning rate, evaluation metrics) and
draw their own progress, none of which reaches nbdist's dashboard by itself. Each library
gets a module here that plugs into the library's own extension point (a ``TrainerCallback``,
a wrap of ``Accelerator.log``, a Lightning logger) and hands what it sees to the measurement
model, as :func:`nbdist.log <nbdist.runtime.progress.log>` and
:class:`nbdist.progress <nbdist.runtime.progress.progress>` do.

The runtime never imports a library itself. A cell with telemetry on (:func:`begin_cell`,
called by the measurement model) activates the library modules whose trigger module the
process already has, and watches the cell's imports (a finder on ``sys.meta_path``) for the
others: a library first imported inside the cell is activated the moment its trigger module
is loaded. :func:`end_cell` deactivates them again, so that between cells and under
``--no-telemetry`` the libraries run as the user installed them.

A library module has two functions, ``activate()`` and ``deactivate()``, both idempotent;
:data:`LIBRARIES` names it after its trigger module. Stdlib only here.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Any, Optional

#: trigger module (the library's module that holds the extension point) -> our module, in
#: this package, that activates for it
LIBRARIES: dict[str, str] = {
    "transformers.trainer": "huggingface",
    "accelerate.accelerator": "accelerate",
    # Lightning's two spellings, each with its Trainer's callback lookup and its Fabric
    "lightning.pytorch.trainer.connectors.callback_connector": "lightning",
    "pytorch_lightning.trainer.connectors.callback_connector": "lightning",
    "lightning.fabric.fabric": "lightning",
    "lightning_fabric.fabric": "lightning",
    "deepspeed.runtime.engine": "deepspeed",
}

_active: dict[str, ModuleType] = {}  # trigger -> our activated module
_lock = threading.RLock()


def _warn(what: str, exc: BaseException) -> None:
    # A library's new release may move what we plug into: the user's training must go on.
    sys.__stderr__.write(f"nbdist: {what}: {exc!r}; its values will not show in the "
                         f"dashboard\n")


def activate(trigger: str) -> Optional[ModuleType]:
    """Activate the module of ``trigger`` (a key of :data:`LIBRARIES`); None if it failed."""
    with _lock:
        if trigger in _active:
            return _active[trigger]
        name = f"{__name__}.{LIBRARIES[trigger]}"
        try:
            module = importlib.import_module(name)
            module.activate()
        except Exception as exc:
            _warn(f"could not plug into {trigger.split('.')[0]}", exc)
            return None
        _active[trigger] = module
        return module


class _Loaded:
    """A loader that runs the library's own, then activates our module for it."""

    def __init__(self, loader: Any, trigger: str) -> None:
        self.loader, self.trigger = loader, trigger

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            self.loader.exec_module(module)
        finally:  # the module is the library's from here on, loader included
            module.__loader__ = self.loader
            if module.__spec__ is not None:
                module.__spec__.loader = self.loader
        activate(self.trigger)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class _Watch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands a trigger module's spec back with :class:`_Loaded`."""

    def __init__(self) -> None:
        self.busy: set[str] = set()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in LIBRARIES or name in self.busy or name in _active:
            return None
        self.busy.add(name)
        try:  # the finders after this one find it, as they would have
            spec = importlib.util.find_spec(name)
        finally:
            self.busy.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loaded(spec.loader, name)
        return spec


_watch = _Watch()


def begin_cell() -> None:
    """A cell with telemetry starts: activate the libraries the process has, watch for the
    rest."""
    for trigger in LIBRARIES:
        if trigger in sys.modules:
            activate(trigger)
    if len(_active) < len(LIBRARIES) and _watch not in sys.meta_path:
        sys.meta_path.insert(0, _watch)


def end_cell() -> None:
    """The cell ended: stop watching imports and deactivate every activated library module."""
    try:
        sys.meta_path.remove(_watch)
    except ValueError:
        pass
    with _lock:
        active = list(_active.items())
        _active.clear()
    for trigger, module in active:
        try:
            module.deactivate()
        except Exception as exc:
            _warn(f"could not unplug from {trigger.split('.')[0]}", exc)
