"""The workers' half of tuning: a DDP setting put on every model a cell builds, and a trial
cut at its step budget on every rank at once. The notebook's half is :mod:`nbdist.tuning`.

Worker-only (torch at the top). :mod:`.ddp_hooks`, which patches ``DDP.__init__`` and the
optimizer-step hooks, calls in here; nothing here patches torch itself.

* **The setting** (:class:`~.spec.DDPSettings`, from the cell's :class:`~.spec.Measure`): in
  ``DDP.__init__`` each knob the cell's code did not pass is set (:func:`settle`); the code's
  own arguments always win. A compression hook is registered after the constructor unless
  the model already has one, in a place the cell's own ``register_comm_hook`` takes over
  (:func:`hook_for`). Each model built reports what it runs with, and what nbdist set, as a
  ``ddp`` event (:func:`report`).
* **The trial budget** (``Measure.trial_steps``): the optimizer-step post-hook counts the
  outermost optimizer steps of the cell and raises :class:`TrialDone` after the last one.
  Every rank of a data-parallel cell steps its optimizer the same number of times, at the
  same point of its program, and nothing is in flight after a step returns: DDP waited for
  its gradient all-reduce in the backward, and ZeRO's broadcasts come before its outer step
  returns. So every rank leaves the cell at the same step, none inside a collective.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Callable, Optional

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from ...telemetry import events as ev
from .model import measurements
from .spec import DDP_KNOBS, DDPSettings, Measure

#: the iteration a trial's PowerSGD starts compressing at (torch's default, 1000, is past
#: any trial: its first iterations are plain all-reduces, by design, to warm up)
TRIAL_POWERSGD_START = 2

_SIGNATURE = inspect.signature(DDP.__init__)


class TrialDone(BaseException):
    """A tuning trial took its optimizer steps: the cell stops here, on every rank.

    A ``BaseException``, so that the cell's own ``except Exception`` does not catch it.
    """


class _Cell:
    """What the running cell asked for: its setting, and a trial's budget and count."""

    __slots__ = ("settings", "budget", "steps", "depth", "cut", "models", "sink")

    def __init__(self) -> None:
        self.settings = DDPSettings()
        self.budget: Optional[int] = None
        self.steps = 0  # outermost optimizer steps so far in a trial
        self.depth = 0  # optimizer.step() calls in progress (ZeRO nests two)
        self.cut = False
        self.models = 0  # DDP models built in the cell
        self.sink: Any = None


_cell = _Cell()


def begin_cell(sink: Any, measure: Measure) -> None:
    """A cell starts: DDP models it builds get ``measure.ddp``; a trial starts counting (and
    the process's memory peaks are reset, so a trial's peak is its own)."""
    _cell.settings, _cell.budget = measure.ddp, measure.trial_steps
    _cell.steps = _cell.depth = _cell.models = 0
    _cell.cut = False
    _cell.sink = sink
    if measure.trial_steps is not None:
        _reset_peaks()


def end_cell() -> None:
    """A trial reports how many optimizer steps it took and whether its budget cut it."""
    if _cell.budget is not None and _cell.sink is not None:
        _cell.sink.emit(ev.trial(time.time(), steps=_cell.steps, cut=_cell.cut,
                                 budget=_cell.budget))
    _cell.budget, _cell.sink, _cell.settings = None, None, DDPSettings()


def _reset_peaks() -> None:
    try:  # Linux: "5" resets the resident set's high-water mark (getrusage's maxrss too)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


# ----------------------------------------------------------------- the setting
class Choice:
    """What the cell's setting did to one DDP model: the knobs nbdist set, the knobs the cell's
    code set itself (they win), and the compression hook the setting asks for."""

    __slots__ = ("applied", "explicit", "hook")

    def __init__(self, applied: list[str], explicit: list[str], hook: Optional[str]):
        self.applied = applied
        self.explicit = explicit
        self.hook = hook

    def hooked(self, by_setting: bool) -> None:
        """A comm hook was registered: the setting's (``by_setting``), or the cell's own, which
        takes the setting's place."""
        if by_setting:
            self.applied.append("comm_hook")
            return
        if "comm_hook" in self.applied:
            self.applied.remove("comm_hook")
        if "comm_hook" not in self.explicit:
            self.explicit.append("comm_hook")


def settle(args: tuple, kwargs: dict[str, Any]) -> Choice:
    """Put the cell's setting into ``DDP(*args, **kwargs)`` (``args`` start with the model
    itself): each knob the call does not pass; the ones it passes are kept."""
    try:
        given = _SIGNATURE.bind_partial(None, *args, **kwargs).arguments
    except TypeError:  # arguments DDP itself refuses: let it say so, with nothing added
        return Choice([], [], None)
    explicit = [k for k in DDP_KNOBS if k in given]
    if "bucket_cap_mb_list" in given and "bucket_cap_mb" not in explicit:
        explicit.append("bucket_cap_mb")  # buckets sized one by one: not ours to change
    applied = []
    settings = _cell.settings
    for knob, value in settings.given().items():
        if knob in DDP_KNOBS and knob not in explicit:
            kwargs[knob] = value
            applied.append(knob)
    return Choice(applied, explicit, settings.comm_hook)


def hook_for(ddp: Any, name: str) -> tuple[Any, Callable]:
    """``(state, hook)`` of the compression hook ``name`` for ``ddp``."""
    group = ddp.process_group
    if name == "fp16":
        return group, default_hooks.fp16_compress_hook
    if name == "bf16":
        return group, default_hooks.bf16_compress_hook
    start = TRIAL_POWERSGD_START if _cell.budget is not None else 1000
    return powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                  start_powerSGD_iter=start), powersgd.powerSGD_hook


#: torch's hooks by the name a setting gives them
_HOOK_NAMES = {"fp16_compress_hook": "fp16", "bf16_compress_hook": "bf16",
               "powerSGD_hook": "powersgd", "batched_powerSGD_hook": "powersgd"}


def hook_name(hook: Any) -> str:
    """A comm hook as a setting names it (``"fp16"``), else its own name."""
    name = getattr(hook, "__qualname__", None) or repr(hook)
    return _HOOK_NAMES.get(name.rsplit(".", 1)[-1], name)


def report(ddp: Any, choice: Optional[Choice] = None, hook: Optional[str] = None,
           by_setting: bool = False) -> None:
    """Send what ``ddp`` runs with as a ``ddp`` event: when it is built (with the ``choice``
    :func:`settle` made), and again when a comm hook (``hook``, by name) is registered, by
    the setting (``by_setting``) or by the cell."""
    sink = _cell.sink
    if choice is not None:
        ddp._nbdist_model = _cell.models  # type: ignore[attr-defined]
        ddp._nbdist_choice = choice  # type: ignore[attr-defined]
        _cell.models += 1
    choice = getattr(ddp, "_nbdist_choice", None)
    if choice is None:
        return  # built before nbdist's patch: nothing to say about it
    if hook is not None:
        ddp._nbdist_hook = hook  # type: ignore[attr-defined]
        choice.hooked(by_setting)
    if sink is None:
        return  # built outside a cell (the worker's warm-up)
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    cap = getattr(ddp, "bucket_bytes_cap", None)
    sink.emit(ev.ddp_model(
        time.time(), model=ddp._nbdist_model, params=sum(p.numel() for p in params),
        tensors=len(params), nbytes=sum(p.numel() * p.element_size() for p in params),
        bucket_cap_mb=cap / 2**20 if cap else None,
        gradient_as_bucket_view=bool(ddp.gradient_as_bucket_view),
        static_graph=bool(ddp.static_graph), comm_hook=getattr(ddp, "_nbdist_hook", None),
        applied=list(choice.applied), explicit=list(choice.explicit)))


# ----------------------------------------------------------------- the trial budget
def step_begins() -> None:
    """Before ``optimizer.step()``: a trial counts how deep the step calls are nested."""
    if _cell.budget is not None and not getattr(measurements.local, "server", False):
        _cell.depth += 1


def step_ended() -> None:
    """After ``optimizer.step()``: the outermost step of a trial counts, and the last one
    ends the cell (:class:`TrialDone`). A parameter server's thread does not count."""
    if _cell.budget is None or getattr(measurements.local, "server", False):
        return
    _cell.depth = max(0, _cell.depth - 1)
    if _cell.depth:
        return  # an inner optimizer (ZeRO's): the outer one's step counts
    _cell.steps += 1
    if _cell.steps >= _cell.budget:
        _cell.cut = True
        raise TrialDone(f"tuning trial done after {_cell.steps} optimizer steps")
