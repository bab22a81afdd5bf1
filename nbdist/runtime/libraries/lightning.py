"""Lightning on a rank: the Trainer's ``self.log`` values and progress, and ``fabric.log``,
in nbdist's dashboard.

Both spellings of the library are served, ``lightning`` (``lightning.pytorch``,
``lightning.fabric``) and the standalone ``pytorch_lightning`` / ``lightning_fabric``.

* **Trainer.** Its extension point for callbacks that come from outside the user's code is
  the callbacks factory: every Trainer adds what ``_load_external_callbacks`` returns for the
  ``lightning.pytorch.callbacks_factory`` group (installed packages declare factories as entry
  points there). While a cell with telemetry runs, :func:`activate` has the callback
  connector's lookup add one :class:`Reporter` to that list, so every Trainer made in a cell
  carries one; :func:`deactivate` puts the lookup back when the cell ends. A Trainer made in a
  cell and fitted in a later one keeps its reporter, which reports only inside cells with
  telemetry on.
* **Fabric.** ``fabric.log`` and ``fabric.log_dict`` hand values to the loggers given to
  ``Fabric(loggers=...)``; :func:`activate` wraps ``Fabric.log_dict`` (which ``log`` calls)
  so that every rank's values are the rank's logged values first, then Fabric's own runs.
  ``fabric.loggers`` stays what the user made it.

What a reporter sends:

* ``trainer.callback_metrics`` (everything ``self.log`` logged: ``train_loss`` or
  ``train_loss_step`` / ``_epoch``, ``val_*`` metrics) as the rank's logged values, every
  0.1 s during training and at the end of each epoch, validation and fit, whatever
  ``log_every_n_steps`` and ``logger`` say (those choose what reaches Lightning's loggers);
* the optimizer steps (``global_step`` of ``estimated_stepping_batches``) as the rank's
  progress, on the ranks where Lightning draws no ``tqdm`` bar of its own (its
  ``TQDMProgressBar`` on global rank zero is already the rank's progress).

The steps themselves, and samples per second, come from the DDP model the strategy wraps
(:mod:`nbdist.runtime.measure.ddp_hooks`) and the optimizer's step, as for a loop of the
user's.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any, Optional

from . import report

#: per spelling: (callback connector module, callbacks factory group, Callback's module,
#: tqdm progress bar's module)
TRAINERS = (
    ("lightning.pytorch.trainer.connectors.callback_connector",
     "lightning.pytorch.callbacks_factory", "lightning.pytorch.callbacks",
     "lightning.pytorch.callbacks.progress.tqdm_progress"),
    ("pytorch_lightning.trainer.connectors.callback_connector",
     "pytorch_lightning.callbacks_factory", "pytorch_lightning.callbacks",
     "pytorch_lightning.callbacks.progress.tqdm_progress"),
)
#: per spelling: the module that holds ``Fabric``
FABRICS = ("lightning.fabric.fabric", "lightning_fabric.fabric")
#: the trigger modules (keys of :data:`nbdist.runtime.libraries.LIBRARIES`)
TRIGGERS = tuple(t[0] for t in TRAINERS) + FABRICS

# How often values are read during training (seconds): each read is an ``.item()`` per value.
_EVERY = 0.1

_reporters: dict[str, type] = {}  # Callback's module -> the Reporter subclassing it


def reporter_class(callbacks_module: str, tqdm_module: str) -> type:
    """The ``Callback`` subclass that reports, for one spelling (made once it is imported)."""
    if callbacks_module in _reporters:
        return _reporters[callbacks_module]
    callback = sys.modules[callbacks_module].Callback
    tqdm_bar = getattr(sys.modules.get(tqdm_module), "TQDMProgressBar", None)

    class Reporter(callback):  # type: ignore[misc, valid-type]
        """Reports a Trainer's logged values and steps to nbdist inside ``%%distributed``
        cells."""

        def __init__(self) -> None:
            self.bar: Optional[report.Bar] = None
            self.sent = 0.0

        def _values(self, trainer: Any) -> None:
            self.sent = time.time()
            report.values(trainer.callback_metrics)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            drawn = (tqdm_bar is not None and trainer.is_global_zero
                     and isinstance(trainer.progress_bar_callback, tqdm_bar))
            if not drawn:
                total = trainer.estimated_stepping_batches
                self.bar = report.Bar(int(total) if total == total and total != float("inf")
                                      else None, "fit")
                self.bar.at(trainer.global_step)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if self.bar is not None:
                self.bar.at(trainer.global_step)
            if time.time() - self.sent >= _EVERY:
                self._values(trainer)

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            self._values(trainer)

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            self._values(trainer)

        def on_test_end(self, trainer: Any, pl_module: Any) -> None:
            self._values(trainer)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._values(trainer)
            if self.bar is not None:
                self.bar.at(trainer.global_step)
                self.bar.close()
                self.bar = None

    Reporter.__module__ = __name__
    _reporters[callbacks_module] = Reporter
    return Reporter


def _with_reporter(original: Any, group: str, callbacks_module: str, tqdm_module: str) -> Any:
    @functools.wraps(original)
    def load(name: str, *args: Any, **kwargs: Any) -> Any:
        found = original(name, *args, **kwargs)
        if name == group:
            found = [*found, reporter_class(callbacks_module, tqdm_module)()]
        return found

    load._nbdist_original = original  # type: ignore[attr-defined]
    return load


def _wrap_log_dict(original: Any) -> Any:
    @functools.wraps(original)
    def log_dict(self: Any, metrics: Any, *args: Any, **kwargs: Any) -> Any:
        if hasattr(metrics, "items"):
            report.values(metrics)
        return original(self, metrics, *args, **kwargs)

    log_dict._nbdist_original = original  # type: ignore[attr-defined]
    return log_dict


def activate() -> None:
    """Add a reporter to every Trainer made from now on, and wrap ``Fabric.log_dict``, for
    each spelling the process has loaded."""
    for connector, group, callbacks_module, tqdm_module in TRAINERS:
        module = sys.modules.get(connector)
        if module is None or not hasattr(module, "_load_external_callbacks"):
            continue
        if getattr(module._load_external_callbacks, "_nbdist_original", None) is None:
            module._load_external_callbacks = _with_reporter(
                module._load_external_callbacks, group, callbacks_module, tqdm_module)
    for name in FABRICS:
        module = sys.modules.get(name)
        if module is None or not hasattr(module, "Fabric"):
            continue
        original = module.Fabric.__dict__["log_dict"]
        if getattr(original, "_nbdist_original", None) is None:
            module.Fabric.log_dict = _wrap_log_dict(original)


def deactivate() -> None:
    """Put Lightning's own callback lookup and ``Fabric.log_dict`` back."""
    for connector, *_ in TRAINERS:
        module = sys.modules.get(connector)
        original = getattr(getattr(module, "_load_external_callbacks", None),
                           "_nbdist_original", None)
        if original is not None:
            module._load_external_callbacks = original  # type: ignore[union-attr]
    for name in FABRICS:
        cls = getattr(sys.modules.get(name), "Fabric", None)
        original = getattr(cls.__dict__.get("log_dict") if cls else None, "_nbdist_original",
                           None)
        if original is not None:
            cls.log_dict = original  # type: ignore[union-attr]
