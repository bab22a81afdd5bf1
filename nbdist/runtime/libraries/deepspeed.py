"""DeepSpeed on a rank: the loss it is given and its learning rate, in nbdist's dashboard.

A DeepSpeed engine logs only through its monitor (TensorBoard, CSV, W&B, Comet, when the
config enables one, on global rank zero), and what it writes there is its learning rate,
loss scale and timers, never the loss. Its methods are where the values pass: while a cell
with telemetry runs, :func:`activate` wraps ``DeepSpeedEngine.backward`` (the loss the user
hands it: the rank's ``loss``, read at most every 0.1 s, since ``.item()`` waits for the
device) and ``DeepSpeedEngine.step`` (after an optimizer step at a gradient accumulation
boundary: ``lr``, and ``loss_scale`` under fp16); :func:`deactivate` puts them back when the
cell ends.

The steps are the optimizer steps ZeRO's inner ``torch.optim`` optimizer takes (one per
boundary; a step skipped for an fp16 overflow is not one), counted by the measurement model's
optimizer hooks as for a loop of the user's.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any

from . import report

TRIGGER = "deepspeed.runtime.engine"

# How often the loss is read (seconds): each read waits for the device.
_EVERY = 0.1
_sent = [0.0]


def _wrap(original: Any, after: Any) -> Any:
    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        try:
            after(self, *args, **kwargs)
        except Exception:  # a value nbdist cannot read must not stop the training
            pass
        return out

    method._nbdist_original = original  # type: ignore[attr-defined]
    return method


def _backward(engine: Any, loss: Any = None, *args: Any, **kwargs: Any) -> None:
    now = time.time()
    if loss is not None and now - _sent[0] >= _EVERY:
        _sent[0] = now
        report.values({"loss": loss.detach()})


def _step(engine: Any, *args: Any, **kwargs: Any) -> None:
    if not engine.was_step_applied():
        return
    values = {"lr": engine.get_lr()[0]}
    if engine.fp16_enabled():
        values["loss_scale"] = engine._get_optimizer_loss_scale()
    report.values(values)


def activate() -> None:
    """Wrap ``DeepSpeedEngine.backward`` and ``step`` so that they report to nbdist too."""
    # Each cell's first loss is read: a short cell run again can begin within _EVERY of the
    # previous cell's last read, and would otherwise report none of its first steps' losses.
    _sent[0] = 0.0
    cls = sys.modules[TRIGGER].DeepSpeedEngine
    for name, after in (("backward", _backward), ("step", _step)):
        original = cls.__dict__[name]
        if getattr(original, "_nbdist_original", None) is None:
            setattr(cls, name, _wrap(original, after))


def deactivate() -> None:
    """Put DeepSpeed's own methods back."""
    cls = getattr(sys.modules.get(TRIGGER), "DeepSpeedEngine", None)
    for name in ("backward", "step"):
        original = getattr(cls.__dict__.get(name) if cls else None, "_nbdist_original", None)
        if original is not None:
            setattr(cls, name, original)
