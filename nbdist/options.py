"""Pure parsers and frozen option records for the magics and the Python API.

Nothing here touches processes, IPython or torch: it is unit-tested on its own. Bad values raise
:class:`~nbdist.errors.OptionError` (a ``ValueError``), which the magics show as usage errors.

The records are also the schema of a cluster profile (:mod:`nbdist.profiles`): their type hints
say what a value may be (a ``Literal`` for a choice; engines and launchers are checked against
the registered ones, :mod:`nbdist.backends.registry`), their ``__post_init__`` what values go
together, and each field set by a profile names its key there (``_in_profile``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Optional, get_args

from .backends.registry import ENGINES, LAUNCHERS, default_engine, lookup
from .errors import OptionError
from .runtime.measure.spec import Measure

# Each choice is written once, as the type a record's field has; the tuples are for the
# magics' argument parsers and the records' own checks. Engines and their launchers are the
# registered ones (nbdist.backends.registry): ENGINES and LAUNCHERS are views of it.
Device = Literal["auto", "cpu", "cuda"]
DistBackend = Literal["auto", "gloo", "nccl"]
OutputMode = Literal["rank0", "all", "quiet"]
DEVICES: tuple[str, ...] = get_args(Device)
DIST_BACKENDS: tuple[str, ...] = get_args(DistBackend)
OUTPUT_MODES: tuple[str, ...] = get_args(OutputMode)


def parse_ranks(spec: Optional[str], world_size: int) -> tuple[int, ...]:
    """Parse a rank selection such as ``"0,2-3"`` or ``"all"``.

    Parameters
    ----------
    spec : str or None
        Comma-separated ranks and inclusive ranges; ``None``/``"all"`` selects every rank.
    world_size : int
        Number of ranks in the job; selections outside ``0..world_size-1`` are rejected.

    Returns
    -------
    tuple of int
        The selected ranks, ascending, each once.

    Raises
    ------
    OptionError
        ``spec`` is not numbers and ranges, has a range that runs backwards, selects no rank,
        or selects ranks outside the job (the message names them).

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


def check_choice(value: str, choices: Sequence[str], what: str, key: str = "") -> str:
    """Return ``value`` if it is one of ``choices`` (a tuple, or a view of the registered
    engines or launchers).

    Raises
    ------
    OptionError
        ``value`` is not one of them; the message lists them, with the nearest as a hint for
        a misspelt one, and ``key`` names the profile key.
    """
    if value not in choices:
        near = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.6)
        raise OptionError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}"
                          + (f"; did you mean {near[0]!r}?" if near else ""), key=key)
    return value


def check_positive(value: Optional[float], what: str, key: str = "") -> Optional[float]:
    """Return ``value`` if it is None or more than 0.

    Raises
    ------
    OptionError
        ``value`` is 0 or less; the message names it as ``what``, and ``key`` names the
        profile key.
    """
    if value is not None and value <= 0:
        raise OptionError(f"{what} must be positive, got {value}", key=key)
    return value


def check_at_least(value: Optional[int], low: int, what: str, key: str = "") -> Optional[int]:
    """Return ``value`` if it is None or ``low`` or more, else raise :class:`OptionError`.

    Raises
    ------
    OptionError
        ``value`` is less than ``low``; the message names it as ``what``, and ``key`` names
        the profile key.
    """
    if value is not None and value < low:
        raise OptionError(f"{what} must be at least {low}, got {value}", key=key)
    return value


#: the metadata of a record's field that holds its dotted key in a profile
PROFILE_KEY = "profile"  # Measure (a leaf) spells it too


def _in_profile(key: str, default: Any = None, factory: Optional[Callable[[], Any]] = None
                ) -> Any:
    """A record's field that a profile sets with the dotted ``key`` (``"cluster.workers"``).

    The ``key``'s last part is also what an :class:`OptionError` about the field names.
    """
    if factory is not None:
        return field(default_factory=factory, metadata={PROFILE_KEY: key})
    return field(default=default, metadata={PROFILE_KEY: key})


@dataclass(frozen=True)
class LaunchOptions:
    """Where nbdist starts workers: this machine (``local``), or a launcher of the engine.

    ``hosts`` maps host names to workers on each (ipyparallel's SSH launcher, Dask's
    SSHCluster). The resource fields are translated for each launcher (a batch queue, an
    account, a wall time, cores, memory and GPUs per worker, a container image); ``options``
    go unchanged to the launcher class as keyword arguments or configuration. ``listen`` is
    the address the controller or scheduler binds when workers run on other machines: nbdist
    never leaves loopback unless told. ``template`` forks the workers a local launch starts
    from one process that has imported torch (see :mod:`nbdist.boot.template`).

    Raises
    ------
    OptionError
        An unknown launcher, fewer than 1 CPU or 0 GPUs per worker, or a host with fewer than
        1 worker.
    """

    #: one of :data:`LAUNCHERS`: ``local``, or a launcher of the engine
    launcher: str = _in_profile("cluster.launcher", "local")
    listen: Optional[str] = _in_profile("cluster.listen")
    hosts: Mapping[str, int] = _in_profile("cluster.hosts", factory=dict)
    cpus: Optional[int] = _in_profile("cluster.resources.cpus")
    memory: Optional[str] = _in_profile("cluster.resources.memory")
    gpus: Optional[int] = _in_profile("cluster.resources.gpus")
    queue: Optional[str] = _in_profile("cluster.resources.queue")
    account: Optional[str] = _in_profile("cluster.resources.account")
    walltime: Optional[str] = _in_profile("cluster.resources.walltime")
    image: Optional[str] = _in_profile("cluster.resources.image")
    options: Mapping[str, Any] = _in_profile("cluster.resources.options", factory=dict)
    #: fork workers on this host from a process that has imported torch already
    #: (docs/usage.md, "Worker templates"); False starts each as a fresh process
    template: bool = _in_profile("cluster.template", True)

    def __post_init__(self) -> None:
        check_choice(self.launcher, LAUNCHERS, "launcher", key="launcher")
        check_at_least(self.cpus, 1, "cpus per worker", key="cpus")
        check_at_least(self.gpus, 0, "gpus per worker", key="gpus")
        for host, count in self.hosts.items():
            check_at_least(count, 1, f"the workers on host {host!r}", key="hosts")

    @property
    def local(self) -> bool:
        return self.launcher == "local"


@dataclass(frozen=True)
class ClusterOptions:
    """How workers are started or reached, and how their process group is formed.

    Without ``n``, a launch with ``hosts`` starts as many workers as they place. ``timeout``
    is in seconds: for a start and for any collective.

    Raises
    ------
    OptionError
        An unknown engine, device or dist backend; ``timeout`` not positive; ``n`` or
        ``threads`` less than 1; nccl with ``device="cpu"``; a launcher the engine does not
        have; ``listen`` on a local launch, or missing where workers start on other machines;
        ``hosts`` with a launcher other than ssh. ``key`` names the profile key.
    """

    #: one of :data:`ENGINES` (the registered engines; the first is the default)
    engine: str = _in_profile("cluster.engine", default_engine())
    n: Optional[int] = _in_profile("cluster.workers")
    device: Device = _in_profile("runtime.device", "auto")
    dist_backend: DistBackend = _in_profile("runtime.dist_backend", "auto")
    threads: Optional[int] = _in_profile("runtime.threads")
    timeout: float = _in_profile("runtime.timeout", 300.0)
    launch: LaunchOptions = field(default_factory=LaunchOptions)
    #: environment variables every rank gets (with torchrun's), restored when it leaves
    env: Mapping[str, str] = _in_profile("runtime.env", factory=dict)
    #: the directory cells run in on every worker (default: where the worker started)
    working_dir: Optional[str] = _in_profile("runtime.working_dir")

    def __post_init__(self) -> None:
        check_choice(self.engine, ENGINES, "engine", key="engine")
        check_choice(self.device, DEVICES, "device", key="device")
        check_choice(self.dist_backend, DIST_BACKENDS, "dist backend", key="dist_backend")
        check_positive(self.timeout, "--timeout", key="timeout")
        placed = sum(self.launch.hosts.values())
        if self.n is None and placed:  # the hosts say how many; a frozen record fills it here
            object.__setattr__(self, "n", placed)
        check_at_least(self.n, 1, "-n", key="workers")
        check_at_least(self.threads, 1, "--threads", key="threads")
        if self.dist_backend == "nccl" and self.device == "cpu":
            raise OptionError("--dist-backend nccl needs --device cuda (or auto on a GPU host)",
                              key="dist_backend")
        launcher, engine = self.launch.launcher, lookup(self.engine)
        if launcher not in engine.launchers:
            raise OptionError(
                f"the {self.engine} engine has no {launcher!r} launcher: choose one of "
                f"{', '.join(engine.launchers)}", key="launcher")
        if self.launch.local and self.launch.listen:
            raise OptionError("`listen` is for launchers that start workers on other machines; "
                              "a local cluster listens on loopback only", key="listen")
        if self.launch.hosts and launcher != "ssh":
            raise OptionError(f"`hosts` is for the ssh launcher; the {launcher!r} launcher "
                              "places workers itself (pass its own options in "
                              "resources.options)", key="hosts")
        # The controller or scheduler runs here (Dask's SSH workers too), unless the engine's
        # launcher runs it on the cluster's side (dask-kubernetes).
        remote_listener = launcher not in engine.scheduler_on_cluster
        if not self.launch.local and remote_listener and not self.launch.listen:
            raise OptionError(
                f"the {launcher!r} launcher starts workers on other machines, which must reach "
                "this one: set `listen` to this machine's address on the cluster network (or "
                "'*' for every interface); nbdist binds loopback only unless told",
                key="launcher")

    def override(self, **given: Any) -> ClusterOptions:
        """These options with every ``given`` value that is not None put in (validated).

        Raises
        ------
        OptionError
            A name in ``given`` is not an option, or the result is not valid (as the class
            says).
        """
        names = {f.name for f in fields(self)}
        unknown = set(given) - names
        if unknown:
            raise OptionError(f"unknown option(s): {', '.join(sorted(unknown))}")
        return replace(self, **{k: v for k, v in given.items() if v is not None})


@dataclass(frozen=True)
class CellOptions:
    """Options of one ``%%distributed`` cell (``timeout`` and ``stall_after`` in seconds).

    Raises
    ------
    OptionError
        An unknown output mode, ``timeout`` not positive, a negative ``stall_after``, or a
        blank ``name``.
    """

    ranks: Optional[str] = None
    timeout: Optional[float] = None
    output: OutputMode = "rank0"
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
    ``training`` section). ``elastic_max_failures`` is the budget elastic training reads;
    ``timeout`` is in seconds.

    Raises
    ------
    OptionError
        An unknown output mode, a negative ``stall_after`` or ``elastic_max_failures``, or a
        ``bucket_cap_mb`` or ``timeout`` that is not positive (``key`` names the profile key).
    """

    output: OutputMode = _in_profile("training.output", "rank0")
    #: what cells measure unless their flags say otherwise
    measure: Measure = field(default_factory=Measure)
    timeout: Optional[float] = _in_profile("training.cell_timeout")
    elastic_max_failures: Optional[int] = _in_profile("training.elastic.max_failures")

    def __post_init__(self) -> None:
        check_choice(self.output, OUTPUT_MODES, "output mode", key="output")
        check_at_least(self.measure.stall_after, 0, "stall_after (0: off)", key="stall_after")
        check_positive(self.measure.ddp.bucket_cap_mb, "training.ddp.bucket_cap_mb",
                       key="bucket_cap_mb")
        check_positive(self.timeout, "cell timeout", key="cell_timeout")
        check_at_least(self.elastic_max_failures, 0, "elastic max_failures",
                       key="max_failures")
