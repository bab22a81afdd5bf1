"""Engine adapters, chosen by short name. Each wraps an existing distributed system.

An engine is one folder here and one :func:`~.registry.register` call below (see
:mod:`.registry`, and :class:`.base.Backend` for what its adapter implements). The package
imports only its registry: workers import their engine's worker half through it
(:mod:`.dask.worker`, :mod:`.ipyparallel.worker`) without the notebook's side of the adapters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

from .registry import ENGINES, Engine, Flag, connect_flags, default_engine, lookup, register

if TYPE_CHECKING:
    from .base import Backend

__all__ = ["ENGINES", "Engine", "Flag", "connect_target", "get_backend", "register"]

# The first one registered is the default engine.
register(Engine(
    name="ipyparallel", adapter="nbdist.backends.ipyparallel.adapter:IpyparallelBackend",
    package="ipyparallel", worker="nbdist.backends.ipyparallel.worker",
    launchers=("local", "ssh", "mpi", "slurm", "pbs", "sge", "lsf"),
    ssh_client="openssh", forks_store=True))
register(Engine(
    name="dask", adapter="nbdist.backends.dask.adapter:DaskBackend",
    package="distributed", extra="dask", worker="nbdist.backends.dask.worker",
    launchers=("local", "ssh", "slurm", "pbs", "sge", "lsf", "kubernetes"),
    ssh_client="asyncssh", scheduler_on_cluster=("kubernetes",),
    connect_flags=(
        Flag("--tls-ca-file", "dask over tls://: the CA certificate that signed the cluster's"),
        Flag("--tls-cert", "dask over tls://: this client's certificate"),
        Flag("--tls-key", "dask over tls://: this client's private key (default: in "
                          "--tls-cert)"))))


def get_backend(engine: str) -> Backend:
    """A fresh, unconnected backend for ``engine``, one of :data:`ENGINES`.

    Raises
    ------
    OptionError
        ``engine`` is not registered (the message lists those that are).
    ImportError
        The engine's package is not installed (the message says how to install it).
    """
    from ..options import check_choice

    check_choice(engine, ENGINES, "engine")
    return lookup(engine).load()()


def connect_target(engine: Optional[str], given: Mapping[str, Any]) -> dict[str, Any]:
    """What the engines' own ``%nbdist connect`` flags add to the target of a connect with
    ``engine`` (None: the default engine). ``given`` maps each flag's
    :attr:`~.registry.Flag.dest` to its value, for the flags that were given; the engine's
    adapter makes them keywords of its ``connect`` (Dask's ``--tls-*`` become a
    ``security``).

    Raises
    ------
    OptionError
        ``engine`` is not registered, a flag of another engine was given, or the engine
        refuses the values (a missing file, a flag that needs another).
    ImportError
        Flags were given and the engine's package is not installed.
    """
    from ..errors import OptionError
    from ..options import check_choice

    engine = engine or default_engine()
    check_choice(engine, ENGINES, "engine")
    foreign = [(owner.name, flag.option) for owner, flag in connect_flags()
               if flag.dest in given and owner.name != engine]
    if foreign:
        options = [option for _, option in foreign]
        raise OptionError(f"{', '.join(options)} {'is' if len(options) == 1 else 'are'} for "
                          f"--engine {foreign[0][0]}, not {engine}")
    if not given:
        return {}
    return dict(lookup(engine).load().target_from_flags(**given))
