"""The engines nbdist knows, by name: what each one is, declared without importing it.

An engine is one folder under ``nbdist/backends/`` (its adapter, a
:class:`~nbdist.backends.base.Backend`, and the half its workers import) and one
:func:`register` call with an :class:`Engine`: its name, where its adapter is, and the few facts
the rest of nbdist asks about it before the adapter is loaded. Everything that offers a choice
of engine reads it here: the option records' checks (:mod:`nbdist.options`), the magics'
``--engine`` and ``connect`` flags, :func:`nbdist.backends.get_backend`, the SSH check before a
start (:mod:`.remote`), whether the rendezvous store forks from the worker template
(:mod:`nbdist.boot.template`). Nothing outside ``backends/`` compares an engine's name.

Standard library only, and no adapter is imported here: the option records, the worker
template's checks and the workers themselves (which import their engine's worker half through
:mod:`nbdist.backends`) may read it at no cost. The adapter is imported by :meth:`Engine.load`,
on the first start or connect, in the manner of torch elastic's rendezvous handler registry.

:data:`ENGINES` and :data:`LAUNCHERS` are views, read when asked: a parser or a check that holds
one sees an engine registered after it was made. An engine's own ``connect`` flags are added to
the magics' parser when it is made (once, as nbdist's magics are imported): register an engine
that has some before that.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, overload

#: the SSH clients the check before a start can use: OpenSSH's ``ssh`` command (as
#: ipyparallel's launcher runs it) or asyncssh (as Dask's SSH workers connect)
SSH_CLIENTS = ("openssh", "asyncssh")


@dataclass(frozen=True)
class Flag:
    """One of an engine's own ``%nbdist connect`` options, e.g. Dask's ``--tls-cert FILE``.

    The magics' parser offers every registered engine's flags; the values given go to the
    engine's :meth:`~nbdist.backends.base.Backend.target_from_flags`, and a flag of another
    engine than the one connected to is refused.
    """

    #: the option as typed, ``--tls-cert``
    option: str
    #: the parser's help line
    help: str
    metavar: str = "FILE"

    @property
    def dest(self) -> str:
        """The keyword the value is handed on as (``--tls-cert`` -> ``tls_cert``)."""
        return self.option.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Engine:
    """What nbdist knows about an engine before its adapter is imported."""

    #: the short name users type (``--engine NAME``, a profile's ``cluster.engine``)
    name: str
    #: the adapter class as ``"package.module:Class"``, imported by :meth:`load`
    adapter: str
    #: the package that provides the engine (``"distributed"``): its workers import it too,
    #: and it is named, with :attr:`extra`, when it is missing
    package: str
    #: the launchers that start its workers (``"local"`` is this machine)
    launchers: tuple[str, ...]
    #: the module its workers import: nbdist's half of the adapter inside them
    worker: str
    #: nbdist's extra that installs :attr:`package` (None: a dependency of nbdist itself)
    extra: Optional[str] = None
    #: the SSH client its ``ssh`` launcher reaches hosts with (one of :data:`SSH_CLIENTS`);
    #: the check before a start reaches them the same way
    ssh_client: str = "openssh"
    #: a local start with a worker template forks the rendezvous store from that template
    #: too (the template is the engine's own; see :mod:`nbdist.boot.template`)
    forks_store: bool = False
    #: launchers that run the controller or scheduler on the cluster's side: nbdist then
    #: listens for nothing on another network, and needs no ``listen`` (dask-kubernetes)
    scheduler_on_cluster: tuple[str, ...] = ()
    #: its own ``%nbdist connect`` flags
    connect_flags: tuple[Flag, ...] = ()

    def __post_init__(self) -> None:
        if self.ssh_client not in SSH_CLIENTS:
            raise ValueError(f"engine {self.name!r}: ssh_client {self.ssh_client!r} is not one "
                             f"of {', '.join(SSH_CLIENTS)}")
        if ":" not in self.adapter:
            raise ValueError(f"engine {self.name!r}: adapter {self.adapter!r} is not "
                             "'package.module:Class'")

    @property
    def worker_imports(self) -> tuple[str, ...]:
        """What a host must be able to import to run its workers (checked before an SSH
        start)."""
        return ("nbdist", self.package, "torch")

    def available(self) -> bool:
        """Whether :attr:`package` is installed here (nothing is imported)."""
        return importlib.util.find_spec(self.package) is not None

    def load(self) -> Any:
        """The adapter class, imported now.

        Raises
        ------
        ImportError
            The engine's :attr:`package` is not installed; the message says how to install
            it. Any other import error of the adapter is raised as it is.
        """
        module, _, name = self.adapter.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except ImportError as exc:
            if self.available():
                raise
            how = f"nbdist[{self.extra}]" if self.extra else self.package
            raise ImportError(f"the {self.name} engine needs the `{self.package}` package "
                              f"({exc}); install it with: pip install '{how}'") from None


_registered: dict[str, Engine] = {}
_names: tuple[str, ...] = ()
_launchers: tuple[str, ...] = ()


def _refresh() -> None:
    global _names, _launchers
    _names = tuple(_registered)
    _launchers = tuple(dict.fromkeys(la for e in _registered.values() for la in e.launchers))


def register(engine: Engine) -> Engine:
    """Make ``engine`` a choice everywhere nbdist offers one; returns it.

    The first engine registered is the default (:func:`default_engine`).

    Raises
    ------
    ValueError
        Another engine is registered under the same name (:func:`unregister` it first).
    """
    if engine.name in _registered:
        raise ValueError(f"an engine named {engine.name!r} is registered already")
    _registered[engine.name] = engine
    _refresh()
    return engine


def unregister(name: str) -> Engine:
    """Remove the engine registered as ``name``; returns it.

    Raises
    ------
    KeyError
        No engine is registered as ``name``.
    """
    engine = _registered.pop(name)
    _refresh()
    return engine


def lookup(name: str) -> Engine:
    """The engine registered as ``name``.

    Raises
    ------
    KeyError
        No engine is registered as ``name`` (the option records check the name first, with
        an error for people).
    """
    return _registered[name]


def engines() -> tuple[Engine, ...]:
    """Every registered engine, in the order registered."""
    return tuple(_registered.values())


def default_engine() -> str:
    """The engine a start or connect uses when none is named: the first one registered."""
    return _names[0]


def connect_flags() -> list[tuple[Engine, Flag]]:
    """Every registered engine's own ``connect`` flags, with their engine (the first engine to
    declare an option owns it)."""
    seen: dict[str, tuple[Engine, Flag]] = {}
    for e in _registered.values():
        for flag in e.connect_flags:
            seen.setdefault(flag.option, (e, flag))
    return list(seen.values())


class _Names(Sequence[str]):
    """Names read from the registry whenever asked (argparse's ``choices``, a record's check)."""

    def __init__(self, names: Callable[[], tuple[str, ...]], what: str) -> None:
        self._names = names
        self._what = what

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...

    def __getitem__(self, index: Any) -> Any:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, value: object) -> bool:
        return value in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (_Names, tuple, list)):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a tuple that can change

    def __repr__(self) -> str:
        return f"<the registered {self._what}: {', '.join(self._names())}>"


#: the registered engines' names, in the order registered
ENGINES: Sequence[str] = _Names(lambda: _names, "engines")
#: every launcher of any registered engine (``"local"`` is this machine)
LAUNCHERS: Sequence[str] = _Names(lambda: _launchers, "launchers")
