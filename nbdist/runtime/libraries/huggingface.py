"""Hugging Face's ``Trainer`` on a rank: its logs and its progress in nbdist's dashboard.

The Trainer's extension point is the callback: every Trainer starts with the callbacks of
``transformers.trainer.DEFAULT_CALLBACKS``. While a cell with telemetry runs, :func:`activate`
adds :class:`Reporter` there, so every Trainer made in a cell (subclasses included) carries
one; :func:`deactivate` takes it out when the cell ends. A Trainer made in a cell and trained
in a later one keeps its reporter, which reports only inside cells with telemetry on.

What it reports:

* each ``on_log`` (``logging_steps``, ``evaluate()``, the end of ``train()``): the numeric
  values, ``loss``, ``learning_rate``, ``grad_norm``, ``eval_*`` metrics and the final
  ``train_*`` figures, as the rank's logged values (``epoch`` and ``total_flos`` are counts,
  not values, and stay out);
* the optimizer steps (``state.global_step`` of ``state.max_steps``) as the rank's progress,
  on the ranks where transformers draws no bar of its own (its ``tqdm`` bar, on the world's
  process zero unless ``disable_tqdm``, is already the rank's progress).

The steps themselves, and samples per second, come from the DDP model the Trainer trains
(:mod:`nbdist.runtime.measure.ddp_hooks`), as for a loop of the user's.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from . import report

#: logged names that are not values to chart
SKIP = frozenset({"epoch", "total_flos"})

_reporter: Optional[type] = None


def reporter_class() -> type:
    """The ``TrainerCallback`` subclass that reports (made once transformers is imported)."""
    global _reporter
    if _reporter is not None:
        return _reporter
    from transformers.trainer_callback import TrainerCallback

    class Reporter(TrainerCallback):
        """Reports a Trainer's logs and steps to nbdist inside ``%%distributed`` cells."""

        def __init__(self) -> None:
            self.bar: Optional[report.Bar] = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if getattr(args, "disable_tqdm", False) or not state.is_world_process_zero:
                self.bar = report.Bar(state.max_steps or None)
                self.bar.at(state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.bar is not None:
                self.bar.at(state.global_step)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.bar is not None:
                self.bar.at(state.global_step)
                self.bar.close()
                self.bar = None

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                   **kwargs: Any) -> None:
            if logs:
                report.values(logs, SKIP)

    Reporter.__module__ = __name__
    _reporter = Reporter
    return Reporter


def activate() -> None:
    """Add the reporter to the callbacks every Trainer starts with."""
    callbacks = sys.modules["transformers.trainer"].DEFAULT_CALLBACKS
    cls = reporter_class()
    if cls not in callbacks:
        callbacks.append(cls)


def deactivate() -> None:
    """Take the reporter out again (Trainers made meanwhile keep theirs)."""
    module = sys.modules.get("transformers.trainer")
    if module is not None and _reporter in module.DEFAULT_CALLBACKS:
        module.DEFAULT_CALLBACKS.remove(_reporter)
