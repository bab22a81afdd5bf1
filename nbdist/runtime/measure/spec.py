"""What a cell measures: one record that travels whole from the notebook to each rank.

A leaf (stdlib only), so the notebook's option records hold it and the worker reads it without
either importing the other. The fields a profile may set name their key there (``training.*``),
under the metadata key :data:`nbdist.options.PROFILE_KEY`.

It also carries the DDP communication setting the cell's models are built with
(:class:`DDPSettings`: a profile's ``training.ddp``, the session's tuned one, or a tuning
trial's) and a trial's step budget: both change what is measured, and travel with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Optional, get_args


def _profile(key: str, default: Any) -> Any:
    return field(default=default, metadata={"profile": key})


#: the gradient compression hooks a setting may name (torch's DDP comm hooks)
CommHook = Literal["fp16", "bf16", "powersgd"]
COMM_HOOKS: tuple[str, ...] = get_args(CommHook)
#: DDP's constructor arguments a setting may set (the comm hook is registered after it)
DDP_KNOBS = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph")


@dataclass(frozen=True)
class DDPSettings:
    """DDP's communication knobs, set on every ``DistributedDataParallel`` a cell builds.

    None leaves a knob as torch (or the cell's code) has it; a value the cell passes to
    ``DDP(...)`` itself (or a hook it registers) always wins over the one here.

    Attributes
    ----------
    bucket_cap_mb : float, optional
        Gradient bucket size in MiB (torch's default: 25).
    gradient_as_bucket_view : bool, optional
        Gradients are views into the buckets (no copy; torch's default: False).
    static_graph : bool, optional
        The model uses the same parameters in every iteration (torch's default: False).
    comm_hook : {"fp16", "bf16", "powersgd"}, optional
        A gradient compression hook (lossy: the gradients change; bf16 needs NCCL).
    """

    bucket_cap_mb: Optional[float] = _profile("training.ddp.bucket_cap_mb", None)
    gradient_as_bucket_view: Optional[bool] = _profile("training.ddp.gradient_as_bucket_view",
                                                       None)
    static_graph: Optional[bool] = _profile("training.ddp.static_graph", None)
    comm_hook: Optional[CommHook] = _profile("training.ddp.comm_hook", None)

    def given(self) -> dict[str, Any]:
        """The knobs this setting sets (not None), in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    @property
    def lossy(self) -> bool:
        """True when the gradients change (a compression hook)."""
        return self.comm_hook is not None

    @property
    def label(self) -> str:
        """``"bucket_cap_mb=5, comm_hook=fp16"``, or ``"torch's defaults"`` for none."""
        given = self.given()
        if not given:
            return "torch's defaults"
        return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in given.items())


@dataclass(frozen=True)
class Measure:
    """The telemetry switches of one cell.

    Attributes
    ----------
    telemetry : bool
        Time steps, gradient all-reduces and collectives, and stream them (``--no-telemetry``
        turns it off).
    collectives : bool
        Also time ``torch.distributed`` calls made in the cell (``--no-collective-timing``).
    buckets : bool
        DDP models built in the cell time each gradient bucket with a comm hook, instead of
        one span per step from DDP's own timer (``--bucket-timing``).
    stall_after : float, optional
        The hang doctor's threshold in seconds (None: its default; 0: off).
    ddp : DDPSettings
        The communication setting of DDP models built in the cell.
    trial_steps : int, optional
        A tuning trial: the cell is cut on every rank after this many optimizer steps.
    """

    telemetry: bool = _profile("training.telemetry", True)
    collectives: bool = _profile("training.collective_timing", True)
    buckets: bool = _profile("training.bucket_timing", False)
    stall_after: Optional[float] = _profile("training.stall_after", None)
    ddp: DDPSettings = field(default_factory=DDPSettings)
    trial_steps: Optional[int] = None

    def override(self, **given: Any) -> Measure:
        """This record with every ``given`` value that is not None put in."""
        return replace(self, **{k: v for k, v in given.items() if v is not None})


#: a cell's measurements when nothing says otherwise (frozen, so one instance serves all)
DEFAULT = Measure()
