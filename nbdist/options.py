"""Pure parsers and frozen option records for the magics and the Python API.

Nothing here touches processes, IPython or torch: it is unit-tested on its own. Bad values raise
:class:`~nbdist.errors.OptionError` (a ``ValueError``), which the magics show as usage errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

from .errors import OptionError

ENGINES = ("ipyparallel", "dask")
DEVICES = ("auto", "cpu", "cuda")
DIST_BACKENDS = ("auto", "gloo", "nccl")
OUTPUT_MODES = ("rank0", "all", "quiet")
#: how workers are started: on this machine, or through a launcher of the engine
LAUNCHERS = ("local", "ssh", "mpi", "slurm", "pbs", "sge", "lsf", "kubernetes")
#: launchers each engine has (ipyparallel's own; Dask's SSHCluster, dask-jobqueue, dask-kubernetes)
ENGINE_LAUNCHERS = {
    "ipyparallel": ("local", "ssh", "mpi", "slurm", "pbs", "sge", "lsf"),
    "dask": ("local", "ssh", "slurm", "pbs", "sge", "lsf", "kubernetes"),
}


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


def check_choice(value: str, choices: tuple[str, ...], what: str, key: str = "") -> str:
    """Return ``value`` if it is one of ``choices``, else raise :class:`OptionError`."""
    if value not in choices:
        raise OptionError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}",
                          key=key)
    return value


def check_positive(value: Optional[float], what: str, key: str = "") -> Optional[float]:
    if value is not None and value <= 0:
        raise OptionError(f"{what} must be positive, got {value}", key=key)
    return value


@dataclass(frozen=True)
class LaunchOptions:
    """Where nbdist starts workers: this machine (``local``), or a launcher of the engine.

    ``hosts`` maps host names to workers on each (ipyparallel's SSH launcher, Dask's
    SSHCluster). The resource fields are translated for each launcher (a batch queue, an
    account, a wall time, cores, memory and GPUs per worker, a container image); ``options``
    go unchanged to the launcher class as keyword arguments or configuration. ``listen`` is
    the address the controller or scheduler binds when workers run on other machines: nbdist
    never leaves loopback unless told.
    """

    launcher: str = "local"
    listen: Optional[str] = None
    hosts: Mapping[str, int] = field(default_factory=dict)
    cpus: Optional[int] = None
    memory: Optional[str] = None
    gpus: Optional[int] = None
    queue: Optional[str] = None
    account: Optional[str] = None
    walltime: Optional[str] = None
    image: Optional[str] = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice(self.launcher, LAUNCHERS, "launcher", key="launcher")

    @property
    def local(self) -> bool:
        return self.launcher == "local"


@dataclass(frozen=True)
class ClusterOptions:
    """How workers are started or reached, and how their process group is formed."""

    engine: str = "ipyparallel"
    n: Optional[int] = None
    device: str = "auto"
    dist_backend: str = "auto"
    timeout: float = 300.0
    threads: Optional[int] = None
    launch: LaunchOptions = field(default_factory=LaunchOptions)
    #: environment variables every rank gets (with torchrun's), restored when it leaves
    env: Mapping[str, str] = field(default_factory=dict)
    #: the directory cells run in on every worker (default: where the worker started)
    working_dir: Optional[str] = None

    def __post_init__(self) -> None:
        check_choice(self.engine, ENGINES, "engine", key="engine")
        check_choice(self.device, DEVICES, "device", key="device")
        check_choice(self.dist_backend, DIST_BACKENDS, "dist backend", key="dist_backend")
        check_positive(self.timeout, "--timeout", key="timeout")
        if self.n is not None and self.n < 1:
            raise OptionError(f"-n must be at least 1, got {self.n}", key="workers")
        if self.threads is not None and self.threads < 1:
            raise OptionError(f"--threads must be at least 1, got {self.threads}",
                              key="threads")
        if self.dist_backend == "nccl" and self.device == "cpu":
            raise OptionError("--dist-backend nccl needs --device cuda (or auto on a GPU host)",
                              key="dist_backend")
        launcher = self.launch.launcher
        if launcher not in ENGINE_LAUNCHERS[self.engine]:
            raise OptionError(
                f"the {self.engine} engine has no {launcher!r} launcher: choose one of "
                f"{', '.join(ENGINE_LAUNCHERS[self.engine])}", key="launcher")
        if self.launch.local and self.launch.listen:
            raise OptionError("`listen` is for launchers that start workers on other machines; "
                              "a local cluster listens on loopback only", key="listen")
        if self.launch.hosts and launcher != "ssh":
            raise OptionError(f"`hosts` is for the ssh launcher; the {launcher!r} launcher "
                              "places workers itself (pass its own options in "
                              "resources.options)", key="hosts")
        remote_listener = self.engine == "ipyparallel" or launcher in ("slurm", "pbs", "sge",
                                                                        "lsf")
        if not self.launch.local and remote_listener and not self.launch.listen:
            raise OptionError(
                f"the {launcher!r} launcher starts workers on other machines, which must reach "
                "this one: set `listen` to this machine's address on the cluster network (or "
                "'*' for every interface); nbdist binds loopback only unless told",
                key="launcher")

    def override(self, **given: Any) -> ClusterOptions:
        """These options with every ``given`` value that is not None put in (validated)."""
        names = {f.name for f in fields(self)}
        unknown = set(given) - names
        if unknown:
            raise OptionError(f"unknown option(s): {', '.join(sorted(unknown))}")
        return replace(self, **{k: v for k, v in given.items() if v is not None})


@dataclass(frozen=True)
class CellOptions:
    """Options of one ``%%distributed`` cell."""

    ranks: Optional[str] = None
    timeout: Optional[float] = None
    output: str = "rank0"
    name: Optional[str] = None
    #: the hang doctor's threshold in seconds (None: its default; 0: off)
    stall_after: Optional[float] = None

    def __post_init__(self) -> None:
        check_choice(self.output, OUTPUT_MODES, "output mode")
        check_positive(self.timeout, "--timeout")
        if self.stall_after is not None and not self.stall_after >= 0:
            raise OptionError(f"--stall-after must be 0 (off) or a number of seconds, got "
                              f"{self.stall_after}")
        if self.name is not None and not self.name.strip():
            raise OptionError("--name needs a label, e.g. --name zero1")


@dataclass(frozen=True)
class CellDefaults:
    """What a ``%%distributed`` cell does when its own flags say nothing (a profile's
    ``training`` section). ``elastic_*`` is the budget elastic training reads."""

    output: str = "rank0"
    telemetry: bool = True
    collective_timing: bool = True
    bucket_timing: bool = False
    timeout: Optional[float] = None
    elastic_max_failures: Optional[int] = None
    elastic_min_workers: Optional[int] = None

    def __post_init__(self) -> None:
        check_choice(self.output, OUTPUT_MODES, "output mode", key="output")
        check_positive(self.timeout, "cell timeout", key="cell_timeout")
