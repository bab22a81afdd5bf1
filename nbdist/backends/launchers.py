"""The rules every engine's launchers keep; each engine's recipes lie in its own folder.

:mod:`.ipyparallel.launchers` names ipyparallel's own engine launcher (local, ssh, mpi, Slurm,
PBS, ...) with its configuration; :mod:`.dask.launchers` names the cluster class of
distributed, dask-jobqueue or dask-kubernetes (or nbdist's own SSH cluster) with its
arguments, and the setting every Dask worker nbdist spawns is started under. Nothing is started
there; the adapters start what they describe.

Two rules hold for every launcher:

* **Loopback unless told.** Every listener nbdist makes binds ``127.0.0.1`` unless the profile's
  ``listen`` says otherwise: the controller or scheduler and its dashboard bind ``listen``;
  workers on other hosts bind their own address on the network that reaches it (every
  interface for ``listen: "*"``).
* **The profile's options add to nbdist's.** ``resources.options`` are merged into what nbdist
  derives (:func:`merged`): dicts key by key, lists extended, so a user's option never drops
  one of nbdist's of the same kind; a value nbdist also sets is the user's.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any, Optional

#: options whose value is one whole command: the user's replaces nbdist's, never extends it
_WHOLE = frozenset({"engine_cmd", "controller_cmd"})


def merged(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` put into ``base`` deeply: dicts merged key by key, lists extended (base's
    items first), any other value replaced. Neither argument is changed."""
    out = dict(base)
    for key, value in override.items():
        mine = out.get(key)
        if isinstance(mine, Mapping) and isinstance(value, Mapping):
            out[key] = merged(mine, value)
        elif isinstance(mine, list) and isinstance(value, (list, tuple)) and key not in _WHOLE:
            out[key] = [*mine, *(v for v in value if v not in mine)]
        else:
            out[key] = value
    return out


def bind_host(listen: Optional[str]) -> str:
    """The address a listener on this machine binds for ``listen``: loopback when unset,
    ``""`` (every interface) for ``"*"``."""
    if not listen:
        return "127.0.0.1"
    return "" if listen == "*" else listen


def is_loopback(listen: Optional[str]) -> bool:
    """True where ``listen`` keeps every listener on loopback (unset, 127.x, ::1, localhost)."""
    if not listen or listen == "localhost":
        return True
    try:
        return ipaddress.ip_address(listen).is_loopback
    except ValueError:
        return False

