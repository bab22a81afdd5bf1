"""Pure parsers and frozen option records for the magics and the Python API.

Nothing here touches processes, IPython or torch: it is unit-tested on its own. Bad values raise
:class:`~nbdist.errors.OptionError` (a ``ValueError``), which the magics show as usage errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import OptionError

ENGINES = ("ipyparallel", "dask")
DEVICES = ("auto", "cpu", "cuda")
DIST_BACKENDS = ("auto", "gloo", "nccl")
OUTPUT_MODES = ("rank0", "all", "quiet")


def parse_ranks(spec: Optional[str], world_size: int) -> tuple[int, ...]:
    """Parse a rank selection such as ``"0,2-3"`` or ``"all"``.

    Parameters
    ----------
    spec : str or None
        Comma-separated ranks and inclusive ranges; ``None``/``"all"`` selects every rank.
    world_size : int
        Number of ranks in the job; selections outside ``0..world_size-1`` are rejected.

    Examples
    --------
    >>> parse_ranks("0,2-3", 4)
    (0, 2, 3)
    """
    if spec is None or spec.strip().lower() in ("", "all"):
        return tuple(range(world_size))
    ranks: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo_s, sep, hi_s = part.partition("-")
        try:
            lo = int(lo_s)
            hi = int(hi_s) if sep else lo
        except ValueError:
            raise OptionError(
                f"bad rank selection {spec!r}: use numbers and ranges like '0,2-3'"
            ) from None
        if lo > hi:
            raise OptionError(f"bad rank range {part!r}: start is after end")
        ranks.update(range(lo, hi + 1))
    if not ranks:
        raise OptionError(f"rank selection {spec!r} selects no rank")
    bad = sorted(r for r in ranks if r < 0 or r >= world_size)
    if bad:
        raise OptionError(
            f"rank(s) {bad} out of range: this cluster has ranks 0..{world_size - 1}"
        )
    return tuple(sorted(ranks))


def check_choice(value: str, choices: tuple[str, ...], what: str) -> str:
    """Return ``value`` if it is one of ``choices``, else raise :class:`OptionError`."""
    if value not in choices:
        raise OptionError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}")
    return value


def check_positive(value: Optional[float], what: str) -> Optional[float]:
    if value is not None and value <= 0:
        raise OptionError(f"{what} must be positive, got {value}")
    return value


@dataclass(frozen=True)
class ClusterOptions:
    """How workers are started or reached, and how their process group is formed."""

    engine: str = "ipyparallel"
    n: Optional[int] = None
    device: str = "auto"
    dist_backend: str = "auto"
    timeout: float = 300.0
    threads: Optional[int] = None

    def __post_init__(self) -> None:
        check_choice(self.engine, ENGINES, "engine")
        check_choice(self.device, DEVICES, "device")
        check_choice(self.dist_backend, DIST_BACKENDS, "dist backend")
        check_positive(self.timeout, "--timeout")
        if self.n is not None and self.n < 1:
            raise OptionError(f"-n must be at least 1, got {self.n}")
        if self.threads is not None and self.threads < 1:
            raise OptionError(f"--threads must be at least 1, got {self.threads}")
        if self.dist_backend == "nccl" and self.device == "cpu":
            raise OptionError("--dist-backend nccl needs --device cuda (or auto on a GPU host)")


@dataclass(frozen=True)
class CellOptions:
    """Options of one ``%%distributed`` cell."""

    ranks: Optional[str] = None
    timeout: Optional[float] = None
    output: str = "rank0"
    name: Optional[str] = None

    def __post_init__(self) -> None:
        check_choice(self.output, OUTPUT_MODES, "output mode")
        check_positive(self.timeout, "--timeout")
        if self.name is not None and not self.name.strip():
            raise OptionError("--name needs a label, e.g. --name zero1")
