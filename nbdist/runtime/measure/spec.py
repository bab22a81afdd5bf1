"""What a cell measures: one record that travels whole from the notebook to each rank.

A leaf (stdlib only), so the notebook's option records hold it and the worker reads it without
either importing the other. The fields a profile may set name their key there (``training.*``),
under the metadata key :data:`nbdist.options.PROFILE_KEY`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional


def _profile(key: str, default: Any) -> Any:
    return field(default=default, metadata={"profile": key})


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
    """

    telemetry: bool = _profile("training.telemetry", True)
    collectives: bool = _profile("training.collective_timing", True)
    buckets: bool = _profile("training.bucket_timing", False)
    stall_after: Optional[float] = _profile("training.stall_after", None)

    def override(self, **given: Any) -> Measure:
        """This record with every ``given`` value that is not None put in."""
        return replace(self, **{k: v for k, v in given.items() if v is not None})


#: a cell's measurements when nothing says otherwise (frozen, so one instance serves all)
DEFAULT = Measure()
