"""Cluster profiles: a YAML file that says how to start the job, read by ``start --profile``.

Three sections, each optional::

    cluster:            # where the workers run
      engine: ipyparallel
      workers: 4
      launcher: slurm   # local, ssh, mpi, slurm, pbs, sge, lsf, kubernetes
      listen: '*'       # what the controller/scheduler binds when workers run elsewhere
      hosts: {node1: 2, node2: 2}
      resources: {queue: gpu, account: proj, walltime: "02:00:00", cpus: 8, gpus: 1}
    runtime:            # what every rank gets
      device: auto
      dist_backend: auto
      threads: 4
      timeout: 300
      env: {NCCL_DEBUG: WARN}
      working_dir: /scratch/me
    training:           # defaults for %%distributed cells
      output: rank0
      telemetry: true
      elastic: {max_failures: 3}

The schema is pydantic's; errors name the file, the line and the key, and suggest the nearest
valid key. Nothing here starts processes: :func:`load_profile` validates, :func:`to_options`
turns a profile into the option records the session runs on, :func:`from_options` goes back.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
)

from .errors import OptionError, ProfileError
from .options import CellDefaults, ClusterOptions, LaunchOptions

Problem = tuple[Optional[int], str, str]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Section):
    """What each worker asks of the launcher; ``options`` go to the launcher unchanged."""

    cpus: Optional[PositiveInt] = None
    memory: Optional[str] = None
    gpus: Optional[NonNegativeInt] = None
    queue: Optional[str] = None
    account: Optional[str] = None
    walltime: Optional[str] = None
    image: Optional[str] = None
    options: dict[str, Any] = Field(default_factory=dict)


class ClusterSection(_Section):
    engine: Literal["ipyparallel", "dask"] = "ipyparallel"
    workers: Optional[PositiveInt] = None
    launcher: Literal["local", "ssh", "mpi", "slurm", "pbs", "sge", "lsf", "kubernetes"] = \
        "local"
    listen: Optional[str] = None
    hosts: dict[str, PositiveInt] = Field(default_factory=dict)
    resources: Resources = Field(default_factory=Resources)

    @field_validator("hosts", mode="before")
    @classmethod
    def _one_worker_per_listed_host(cls, value: Any) -> Any:
        # `hosts: [a, b]` is one worker on each; `hosts: {a: 4}` says how many.
        if isinstance(value, list) and all(isinstance(h, str) for h in value):
            return {h: 1 for h in value}
        return value


class RuntimeSection(_Section):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    threads: Optional[PositiveInt] = None
    timeout: PositiveFloat = 300.0
    env: dict[str, str] = Field(default_factory=dict)
    working_dir: Optional[str] = None

    @field_validator("env", mode="before")
    @classmethod
    def _numbers_as_text(cls, value: Any) -> Any:
        # `NCCL_IB_DISABLE: 1` is what people write; the environment holds text.
        if isinstance(value, Mapping):
            return {k: str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                    for k, v in value.items()}
        return value


class ElasticSection(_Section):
    max_failures: Optional[NonNegativeInt] = None
    min_workers: Optional[PositiveInt] = None


class TrainingSection(_Section):
    output: Literal["rank0", "all", "quiet"] = "rank0"
    telemetry: bool = True
    collective_timing: bool = True
    bucket_timing: bool = False
    cell_timeout: Optional[PositiveFloat] = None
    elastic: ElasticSection = Field(default_factory=ElasticSection)


class Profile(_Section):
    """A validated profile. Build one with :func:`load_profile` or ``Profile(**dict)``."""

    cluster: ClusterSection = Field(default_factory=ClusterSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    training: TrainingSection = Field(default_factory=TrainingSection)


# Where a key of the option records lives in a profile, to point at its line.
_KEY_LOCATIONS = {
    "engine": ("cluster", "engine"), "workers": ("cluster", "workers"),
    "launcher": ("cluster", "launcher"), "listen": ("cluster", "listen"),
    "hosts": ("cluster", "hosts"), "device": ("runtime", "device"),
    "dist_backend": ("runtime", "dist_backend"), "timeout": ("runtime", "timeout"),
    "threads": ("runtime", "threads"), "output": ("training", "output"),
    "cell_timeout": ("training", "cell_timeout"),
}


# ------------------------------------------------------------------------------ reading
def load_profile(path: Union[str, os.PathLike]) -> Profile:
    """Read and validate the profile at ``path``.

    Raises :class:`~nbdist.errors.ProfileError` naming the file, the line and the key of each
    problem (with the nearest valid key for a misspelt one), for a missing file, bad YAML, an
    unknown key, a value of the wrong type, or options that do not go together.

    Examples
    --------
    >>> profile = load_profile("examples/profiles/local-cpu.yaml")   # doctest: +SKIP
    >>> profile.cluster.workers                                      # doctest: +SKIP
    2
    """
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        where = "" if os.path.isabs(name) else f" (relative to {os.getcwd()})"
        raise ProfileError(name, [(None, "", f"no such file{where}")]) from None
    except OSError as exc:
        raise ProfileError(name, [(None, "", f"cannot read it: {exc.strerror}")]) from None
    return parse_profile(text, name)


def parse_profile(text: str, name: str = "<profile>") -> Profile:
    """Validate profile ``text``; ``name`` is what error messages call the file."""
    try:
        tree = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ProfileError(name, [(mark.line + 1 if mark else None, "",
                                   f"not valid YAML: {problem}")]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ProfileError(name, [(1, "", "a profile is a mapping with the sections cluster, "
                                          "runtime and training")])
    try:
        profile = Profile.model_validate(data)
    except ValidationError as exc:
        problems = sorted((_problem(e, tree) for e in exc.errors()),
                          key=lambda p: (p[0] or 0, p[1]))
        raise ProfileError(name, problems) from None
    try:
        to_options(profile)
    except OptionError as exc:
        loc = _KEY_LOCATIONS.get(exc.key, ())
        raise ProfileError(name, [(_line_of(tree, loc), ".".join(loc), str(exc))]) from None
    return profile


def _problem(error: Any, tree: Optional[yaml.Node]) -> Problem:
    """One pydantic error as (line, dotted key, message for people)."""
    loc = tuple(p for p in error["loc"] if not _is_union_tag(p))
    key = ".".join(str(p) for p in loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        valid = _fields_at(loc[:-1])
        near = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        msg = f"unknown key{hint} Valid keys here: {', '.join(valid)}"
    elif kind == "literal_error":
        choices = re.findall(r"'([^']*)'", error.get("ctx", {}).get("expected", ""))
        near = difflib.get_close_matches(str(error.get("input")), choices, n=1, cutoff=0.6)
        msg = (f"{error['input']!r} is not one of {', '.join(choices)}"
               + (f"; did you mean {near[0]!r}?" if near else ""))
    else:
        msg = f"{error['msg']} (got {error.get('input')!r})"
        if loc[:2] == ("runtime", "env"):
            msg += "; environment values are text: quote it"
    return _line_of(tree, loc), key, msg


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the type it tried for an Optional (`int`, `str`) in the location.
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float",
                                                                "constrained-int",
                                                                "constrained-float"))


def _fields_at(loc: Sequence[Any]) -> list[str]:
    """The keys the schema accepts at ``loc`` (a path of section names)."""
    model: Any = Profile
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        ann = field.annotation if field is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _line_of(tree: Optional[yaml.Node], loc: Sequence[Any]) -> Optional[int]:
    """The 1-based line of the deepest key of ``loc`` present in the YAML ``tree``."""
    node, line = tree, (tree.start_mark.line + 1 if tree is not None else None)
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(part):
                    node, line = v, k.start_mark.line + 1
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) \
                and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


# ------------------------------------------------------------------------------ options
def to_options(profile: Profile) -> tuple[ClusterOptions, CellDefaults]:
    """The cluster options and cell defaults a profile describes (validated together)."""
    c, r, t = profile.cluster, profile.runtime, profile.training
    res = c.resources
    hosts = dict(c.hosts)
    launch = LaunchOptions(
        launcher=c.launcher, listen=c.listen, hosts=dict(hosts), cpus=res.cpus,
        memory=res.memory, gpus=res.gpus, queue=res.queue, account=res.account,
        walltime=res.walltime, image=res.image, options=dict(res.options))
    workers = c.workers
    if hosts and workers is None:
        workers = sum(hosts.values())
    elif hosts and workers is not None and workers > sum(hosts.values()):
        raise OptionError(f"workers: {workers} is more than the {sum(hosts.values())} that "
                          "`hosts` places", key="workers")
    options = ClusterOptions(
        engine=c.engine, n=workers, device=r.device, dist_backend=r.dist_backend,
        timeout=r.timeout, threads=r.threads, launch=launch, env=dict(r.env),
        working_dir=r.working_dir)
    defaults = CellDefaults(
        output=t.output, telemetry=t.telemetry, collective_timing=t.collective_timing,
        bucket_timing=t.bucket_timing,
        timeout=t.cell_timeout, elastic_max_failures=t.elastic.max_failures,
        elastic_min_workers=t.elastic.min_workers)
    return options, defaults


def from_options(options: ClusterOptions, defaults: CellDefaults) -> Profile:
    """The profile that starts a session with ``options`` and ``defaults`` again."""
    launch = options.launch
    resources = {k: getattr(launch, k) for k in ("cpus", "memory", "gpus", "queue", "account",
                                                  "walltime", "image")}
    return Profile.model_validate({
        "cluster": {"engine": options.engine, "workers": options.n,
                    "launcher": launch.launcher, "listen": launch.listen,
                    "hosts": dict(launch.hosts),
                    "resources": {**resources, "options": dict(launch.options)}},
        "runtime": {"device": options.device, "dist_backend": options.dist_backend,
                    "threads": options.threads, "timeout": options.timeout,
                    "env": dict(options.env), "working_dir": options.working_dir},
        "training": {"output": defaults.output, "telemetry": defaults.telemetry,
                     "collective_timing": defaults.collective_timing,
                     "bucket_timing": defaults.bucket_timing,
                     "cell_timeout": defaults.timeout,
                     "elastic": {"max_failures": defaults.elastic_max_failures,
                                 "min_workers": defaults.elastic_min_workers}},
    })


def dump_profile(profile: Profile, header: str = "") -> str:
    """The profile as YAML, unset values left out, with ``header`` as a comment on top."""
    data = _prune(profile.model_dump())
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comment + text


def _prune(value: Any) -> Any:
    """Drop None values and empty mappings, keeping everything else as it is."""
    if isinstance(value, dict):
        out = {k: _prune(v) for k, v in value.items() if v is not None}
        return {k: v for k, v in out.items() if v != {}}
    return value
