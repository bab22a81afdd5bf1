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

A profile is the option records of :mod:`nbdist.options` written as YAML: every field of
:class:`~nbdist.options.ClusterOptions` (its :class:`~nbdist.options.LaunchOptions` too) and of
:class:`~nbdist.options.CellDefaults` names the key that sets it, pydantic checks each value
against the field's type, and the records check what goes together. Errors name the file, the
line and the key, and suggest the nearest valid key or choice. Nothing here starts processes.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Optional, Union, get_type_hints

import yaml
from pydantic import TypeAdapter, ValidationError

from .errors import OptionError, ProfileError
from .options import PROFILE_KEY, CellDefaults, ClusterOptions

Problem = tuple[Optional[int], str, str]
Keys = tuple[str, ...]


@dataclass(frozen=True)
class Profile:
    """A validated profile: the option records it describes.

    Build one with :func:`load_profile` or :func:`parse_profile`, or from records with
    :func:`from_options`; :func:`dump_profile` writes it back as YAML.
    """

    options: ClusterOptions = field(default_factory=ClusterOptions)
    defaults: CellDefaults = field(default_factory=CellDefaults)


def _layout(record: type, at: Keys = ()) -> Iterator[tuple[Keys, Keys]]:
    """(attribute path in ``record``, key path in a profile) of every field a profile sets."""
    hints = get_type_hints(record)
    for f in fields(record):
        if is_dataclass(hints[f.name]):
            yield from _layout(hints[f.name], at + (f.name,))
        elif PROFILE_KEY in f.metadata:
            yield at + (f.name,), tuple(f.metadata[PROFILE_KEY].split("."))


def _nest(pairs: Iterable[tuple[Keys, Any]]) -> dict[str, Any]:
    """Pairs like ``(("a", "b"), 1)`` as nested mappings, ``{"a": {"b": 1}}``."""
    out: dict[str, Any] = {}
    for keys, value in pairs:
        node = out
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return out


# The records a profile holds, each with where its fields sit in the YAML; and the YAML's keys
# as a tree (a section is a mapping, a key None).
_RECORD_TYPES = tuple(get_type_hints(Profile).values())
_RECORDS: TypeAdapter[Any] = TypeAdapter(tuple[_RECORD_TYPES])
_LAYOUTS = tuple(list(_layout(record)) for record in _RECORD_TYPES)
_TREE = _nest((keys, None) for layout in _LAYOUTS for _, keys in layout)


def _one_worker_per_listed_host(value: Any) -> Any:
    # `hosts: [a, b]` is one worker on each; `hosts: {a: 4}` says how many.
    if isinstance(value, list) and all(isinstance(h, str) for h in value):
        return {h: 1 for h in value}
    return value


def _numbers_as_text(value: Any) -> Any:
    # `NCCL_IB_DISABLE: 1` is what people write; the environment holds text.
    if isinstance(value, Mapping):
        return {k: str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                for k, v in value.items()}
    return value


# What YAML lets people write for a key, made into what the record's field holds.
_SHORTHANDS = {("cluster", "hosts"): _one_worker_per_listed_host,
               ("runtime", "env"): _numbers_as_text}


# ------------------------------------------------------------------------------ reading
def load_profile(path: Union[str, os.PathLike]) -> Profile:
    """Read and validate the profile at ``path``.

    Raises :class:`~nbdist.errors.ProfileError` naming the file, the line and the key of each
    problem (with the nearest valid key for a misspelt one), for a missing file, bad YAML, an
    unknown key, a value of the wrong type, or options that do not go together.

    Examples
    --------
    >>> profile = load_profile("examples/profiles/local-cpu.yaml")   # doctest: +SKIP
    >>> profile.options.n                                            # doctest: +SKIP
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
        raise ProfileError(name, [(1, "", "a profile is a mapping with the sections "
                                          f"{', '.join(_TREE)}")])
    values, problems = _sort_out(data, _TREE)
    for keys, shorthand in _SHORTHANDS.items():
        if keys in values:
            values[keys] = shorthand(values[keys])
    given = tuple(_nest((attrs, values[keys]) for attrs, keys in layout if keys in values)
                  for layout in _LAYOUTS)
    try:
        options, defaults = _RECORDS.validate_python(given)
    except ValidationError as exc:
        problems += [_problem(e) for e in exc.errors()]
    else:
        placed = sum(options.launch.hosts.values())
        if placed and options.n > placed:  # the file's own two keys disagree
            problems.append((("cluster", "workers"), f"workers: {options.n} is more than the "
                                                     f"{placed} that `hosts` places"))
    if problems:
        found = {(_line_of(tree, keys), ".".join(keys), msg) for keys, msg in problems}
        raise ProfileError(name, sorted(found, key=lambda p: (p[0] or 0, p[1], p[2])))
    return Profile(options, defaults)


def _sort_out(data: Mapping[Any, Any], tree: Mapping[str, Any], at: Keys = ()
              ) -> tuple[dict[Keys, Any], list[tuple[Keys, str]]]:
    """The values ``data`` gives by key path, and a problem for each key not in ``tree``."""
    values: dict[Keys, Any] = {}
    problems: list[tuple[Keys, str]] = []
    for key, value in data.items():
        keys = at + (str(key),)
        below = tree.get(key)
        if key not in tree:
            near = difflib.get_close_matches(str(key), list(tree), n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else "."
            problems.append((keys, f"unknown key{hint} Valid keys here: {', '.join(tree)}"))
        elif below is None:
            values[keys] = value
        elif isinstance(value, Mapping):
            found, wrong = _sort_out(value, below, keys)
            values.update(found)
            problems += wrong
        elif value is not None:  # a section left empty is all defaults
            problems.append((keys, f"a section of keys ({', '.join(below)}), not {value!r}"))
    return values, problems


def _problem(error: Any) -> tuple[Keys, str]:
    """One pydantic error about the records as (profile key path, message for people)."""
    record, *loc = error["loc"]
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, OptionError):  # a record's own check; its key names the field
        return _keys_named(record, tuple(loc), cause.key), str(cause)
    keys = _keys_at(record, tuple(str(p) for p in loc))
    if error["type"] == "literal_error":
        choices = re.findall(r"'([^']*)'", error["ctx"]["expected"])
        near = difflib.get_close_matches(str(error["input"]), choices, n=1, cutoff=0.6)
        return keys, (f"{error['input']!r} is not one of {', '.join(choices)}"
                      + (f"; did you mean {near[0]!r}?" if near else ""))
    msg = f"{error['msg']} (got {error.get('input')!r})"
    if keys[:2] == ("runtime", "env"):
        msg += "; environment values are text: quote it"
    return keys, msg


def _keys_at(record: int, loc: Keys) -> Keys:
    """The profile key path of the attribute path ``loc`` in record number ``record``."""
    for attrs, keys in _LAYOUTS[record]:
        if loc[:len(attrs)] == attrs:
            return keys + loc[len(attrs):]  # and below it: a host, a variable
    return loc


def _keys_named(record: int, loc: Keys, key: str) -> Keys:
    """The key path of the field under ``loc`` whose profile key ends with ``key``."""
    for attrs, keys in _LAYOUTS[record]:
        if attrs[:len(loc)] == loc and keys[-1] == key:
            return keys
    return ()


def _line_of(tree: Optional[yaml.Node], loc: Keys) -> Optional[int]:
    """The 1-based line of the deepest key of ``loc`` present in the YAML ``tree``."""
    node, line = tree, (tree.start_mark.line + 1 if tree is not None else None)
    for part in loc:
        if not isinstance(node, yaml.MappingNode):
            return line
        for k, v in node.value:
            if k.value == part:
                node, line = v, k.start_mark.line + 1
                break
        else:
            return line
    return line


# ------------------------------------------------------------------------------ options
def to_options(profile: Profile) -> tuple[ClusterOptions, CellDefaults]:
    """The cluster options and cell defaults a profile describes (validated when read)."""
    return profile.options, profile.defaults


def from_options(options: ClusterOptions, defaults: CellDefaults) -> Profile:
    """The profile that starts a session with ``options`` and ``defaults`` again."""
    return Profile(options, defaults)


def dump_profile(profile: Profile, header: str = "") -> str:
    """The profile as YAML, unset values left out, with ``header`` as a comment on top."""
    data = _prune(_nest((keys, _value(record, attrs))
                        for record, layout in zip(to_options(profile), _LAYOUTS)
                        for attrs, keys in layout))
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comment + text


def _value(record: Any, attrs: Keys) -> Any:
    for attr in attrs:
        record = getattr(record, attr)
    return dict(record) if isinstance(record, Mapping) else record


def _prune(value: Any) -> Any:
    """Drop None values and empty mappings, keeping everything else as it is."""
    if isinstance(value, dict):
        out = {k: _prune(v) for k, v in value.items() if v is not None}
        return {k: v for k, v in out.items() if v != {}}
    return value
