"""Stopping the ranks of an interrupted cell, and what happens to ranks that do not stop.

An interrupt (the kernel's stop button, ``--timeout``) reaches a rank's cell as a
``KeyboardInterrupt``: by a signal in the engine's main thread (ipyparallel), or as an
asynchronous exception in the worker's task thread (Dask); a rank waiting in a collective is
cut loose a second later (:mod:`nbdist.runtime.interrupt`, the worker half). A rank blocked
inside one native call *in a thread* is out of reach: Python checks asynchronous exceptions
only between bytecodes, runs signal handlers only in the main thread, and retries a system
call that a signal interrupted (PEP 475). ``time.sleep(600)`` in a Dask worker's thread
ignores all three (``docs/fault-tolerance.md`` has the measurement).

So the cell loop escalates. Where the engine can restart one worker's process (Dask's nanny),
ranks still running :data:`RESTART_GRACE` seconds after the interrupt get a fresh process in
the same rank, the group is formed again at once, and the cell's error says which ranks lost
their namespace and what it held (:class:`~nbdist.errors.RanksRestarted`): the next cell never
waits for an old one. What the old process had imported is imported again in the fresh one,
under the same names (``import torch``, ``import numpy as np``, ``from torch import nn``): a
module is not state, and the message lists only the names that are really lost. Elsewhere
such ranks are reported as stuck after :data:`STOP_GRACE`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

from ..backends.base import Call, Submission, WorkerId
from ..errors import InterruptTimeoutError, RanksRestarted
from ..runtime import worker as rt

if TYPE_CHECKING:
    from ..group.membership import Membership

# How long interrupted ranks get to stop before the engine restarts their processes: a cell
# in Python code stops at once, one in a collective within the watcher's second.
RESTART_GRACE = 5.0
# Where the engine cannot restart one worker: how long before the ranks are called stuck.
STOP_GRACE = 15.0


def stop_ranks(membership: Membership, job: Submission, slots: Mapping[Any, int]
               ) -> Optional[RanksRestarted]:
    """Interrupt the calls of ``job`` still running and wait for them to stop.

    Returns None when every call stopped; what was restarted when the engine replaced the
    processes of ranks that did not. Raises :class:`~nbdist.errors.InterruptTimeoutError`
    where the engine cannot. ``slots`` maps each worker to the rank it reports as.
    """
    backend = membership.require()
    backend.interrupt(job.pending())
    restartable = backend.can_restart_workers
    grace = RESTART_GRACE if restartable else STOP_GRACE
    if job.wait(grace):
        return None
    stuck = job.pending()
    ranks = tuple(sorted(slots[w] for w in stuck))
    if not restartable:
        raise InterruptTimeoutError(list(ranks), grace)
    return restart(membership, job, stuck, slots, grace)


def restart(membership: Membership, job: Submission, stuck: list[WorkerId],
            slots: Mapping[Any, int], grace: float) -> RanksRestarted:
    """Replace the processes of the ``stuck`` workers, form the group again, and import in
    each fresh process what the old one had imported (modules are not state)."""
    backend = membership.require()
    timeout = membership.options.timeout
    # Asked before the processes go, of the processes themselves: what their cells imported
    # in the cell still running too, which no earlier report could say.
    held = {slots[w]: h for w, h in backend.run_beside(stuck, rt.namespace_held).items()}
    hosts = {slots[w]: membership.infos.get(w, {}).get("hostname", "?") for w in stuck}
    replaced = set(backend.restart_workers(stuck, timeout))
    job.wait(timeout)  # the calls on the old processes end as the engine's errors
    removed = tuple(sorted(slots[w] for w in stuck if w not in replaced))
    why = ""
    restored: dict[int, list[str]] = {}
    if removed:
        membership.distrust(stuck)  # the next cell names the missing ranks, with the remedy
    else:
        try:
            membership.form(replace(membership.options, n=len(backend.worker_ids())))
        except Exception as exc:  # the interrupt's error is the news; this is part of it
            why = f"{type(exc).__name__}: {exc}"
            membership.distrust(stuck)
        else:
            # The fresh processes: workers the job did not have, or replaced under their old
            # id; whatever ranks they took, they take the stuck ranks' places in order.
            fresh = [p.worker_id for p in membership.plans
                     if p.worker_id not in slots or p.worker_id in replaced]
            imports = {w: held[k]["imports"] for k, w in zip(sorted(hosts), fresh) if k in held}
            again = restore_imports(membership, imports)
            restored = {k: again[w] for k, w in zip(sorted(hosts), fresh) if w in again}
    names = {k: [*h["names"], *(i[0] for i in h["imports"] if i[0] not in restored.get(k, ()))]
             for k, h in held.items()}
    return RanksRestarted(tuple(sorted(hosts)), grace, membership.world_size or len(slots),
                          hosts, names, removed, why, restored)


def restore_imports(membership: Membership, imports: Mapping[WorkerId, list[rt.Import]]
                    ) -> dict[WorkerId, list[str]]:
    """Import ``imports`` (by worker) again in fresh workers of the job, under the same names;
    returns the names bound again, by worker (one that fails stays lost, and is listed so)."""
    workers = [w for w, i in imports.items() if i]
    if not workers:
        return {}
    try:
        failed = membership.call([Call(w, rt.restore_imports, (imports[w],)) for w in workers],
                                 membership.options.timeout, "import again what they imported")
    except Exception:  # the processes are fresh and the group formed: their names are lost
        return {}
    return {w: sorted(i[0] for i in imports[w] if i[0] not in bad)
            for w, bad in zip(workers, failed)}
