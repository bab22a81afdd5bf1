"""Starting or connecting, and doing so while a cluster runs: re-running the start cell is the
commonest accident in a notebook, and it must not throw away warm workers without a word.

:func:`launch` brings a backend's workers up (or attaches it to a running cluster) and makes it
the membership's; the session then forms the group on them.

With the same options (and, for ``connect``, the same cluster), the running job is kept and
one line says so; otherwise what will stop and what will be lost (the workers, their
namespaces and the names they held) is said before the session replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..backends.base import Backend, Call
from ..boot.template import forks_store
from ..errors import fmt_names
from ..options import ClusterOptions
from ..runtime import worker as rt

if TYPE_CHECKING:
    from .membership import Membership

#: told ``(ready, wanted)`` workers while a start brings them up
Progress = Callable[[int, int], None]

#: how long the running workers get to list the names they hold
_NAMES_TIMEOUT = 10.0
#: how a difference in each option is named
_LABELS = {"n": "workers", "dist_backend": "dist backend", "launch": "launcher settings",
           "env": "environment", "working_dir": "working dir"}


@dataclass(frozen=True)
class Relaunch:
    """What ``start``/``connect`` does with the job that runs: keep it, or replace it."""

    keep: bool
    #: the line that says so (printed by the session)
    message: str


def launch(membership: Membership, backend: Backend, options: ClusterOptions,
           target: Optional[dict[str, Any]], view: Optional[Progress]) -> None:
    """Start ``options.n`` workers with ``backend`` (``target`` None) or attach it to the
    cluster ``target`` names, then make it ``membership``'s backend. ``view`` is told "k of n
    ready" while workers come up. Workers on this machine reach the store on loopback, so it
    is started first: forked from the worker template where the engine forks it, else here.

    Raises
    ------
    ClusterError
        The workers did not start (or the cluster cannot be reached) within
        ``options.timeout`` seconds.
    ImportError
        The engine's or the launcher's package is not installed.
    RuntimeError
        The rendezvous store process failed (``StoreError``).
    """
    if target is None and options.launch.local:
        if forks_store(options):  # from the template, ready once it forked the workers
            view = membership.warming_store(view, options.timeout)
        else:
            membership.warm_store(options.timeout)
    if target is None:
        backend.launch = options.launch
        backend.on_ready = view
        backend.start(options.n or 2, options.timeout)
    else:
        backend.connect(options.timeout, **target)
    membership.backend = backend


def relaunch(membership: Membership, running_target: dict[str, Any], options: ClusterOptions,
             target: Optional[dict[str, Any]]) -> Relaunch:
    """Decide for a running job: ``options`` and ``target`` (None: start workers; else the
    cluster to connect to) against the job's options and ``running_target``."""
    backend = membership.require()
    n = membership.world_size
    workers = f"{n} worker{'s' if n != 1 else ''}"
    why = _why_not_kept(membership, running_target, options, target)
    if not why:
        said = ("already running with these options" if target is None
                else "already connected to this cluster with these options")
        return Relaunch(True, f"{said}: kept its {workers} and their namespaces (warm state "
                              "kept; `%nbdist restart` gets fresh workers)")
    what = backend.describe()
    if backend.owns_cluster:
        names = _names(membership)
        held = {None: "", "": " (no names defined yet)"}.get(names, f" ({names})")
        action = f"stopping its {workers} of {what}; lost: every rank's namespace{held}"
    else:
        action = (f"disconnecting from {what} (its {workers} keep running, with their "
                  "namespaces; nbdist's process group on them ends)")
    then = "starting the new one" if target is None else "connecting"
    return Relaunch(False, f"a cluster is running with {why}: {action}. Then {then} ...")


def _why_not_kept(membership: Membership, running_target: dict[str, Any],
                  options: ClusterOptions, target: Optional[dict[str, Any]]) -> str:
    """Why the running job cannot serve as the one asked for ("" when it can)."""
    backend = membership.require()
    current = membership.options
    if (target is None) != backend.owns_cluster:
        return ("workers nbdist started" if backend.owns_cluster
                else "workers nbdist connected to")
    if target is not None:
        if target != running_target:
            return "another cluster (" + _target_text(running_target) + ")"
        options = replace(options, n=current.n)  # connecting takes the workers there are
    changed = [_change(f.name, getattr(current, f.name), getattr(options, f.name))
               for f in fields(ClusterOptions)
               if getattr(current, f.name) != getattr(options, f.name)]
    if changed:
        return "other options (" + ", ".join(changed) + ")"
    try:
        live = set(backend.worker_ids())
    except Exception as exc:  # the engine does not answer: not a job to keep
        return f"a cluster that does not answer ({type(exc).__name__})"
    gone = [p.rank for p in membership.plans if p.worker_id not in live]
    if gone:
        return f"rank(s) {', '.join(map(str, gone))} gone"
    if target is not None and len(live) != membership.world_size:
        return f"{len(live)} workers there now (the job has {membership.world_size})"
    return ""


def _change(name: str, old: Any, new: Any) -> str:
    label = _LABELS.get(name, name)
    if name in ("launch", "env"):
        return label
    return f"{label} {_show(old)} -> {_show(new)}"


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _target_text(target: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in target.items() if k != "security") or "default"


def _names(membership: Membership) -> Optional[str]:
    """What each rank's namespace holds, in a few words ("" when nothing; None when the
    workers could not say in time)."""
    plans = membership.plans
    try:
        held = membership.call([Call(p.worker_id, rt.defined_names) for p in plans],
                               _NAMES_TIMEOUT, "list the names the workers hold")
    except Exception:
        return None
    if not any(held):
        return ""
    if all(h == held[0] for h in held):
        return f"on every rank: {fmt_names(held[0])}"
    return "; ".join(f"rank {p.rank}: {fmt_names(h) if h else 'nothing'}"
                     for p, h in zip(plans, held))
