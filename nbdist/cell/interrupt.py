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
waits for an old one. Elsewhere such ranks are reported as stuck after :data:`STOP_GRACE`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

from ..backends.base import Submission, WorkerId
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
    """Replace the processes of the ``stuck`` workers and form the group again."""
    backend = membership.require()
    timeout = membership.options.timeout
    held = backend.run_beside(stuck, rt.defined_names)  # asked before the processes go
    hosts = {slots[w]: membership.infos.get(w, {}).get("hostname", "?") for w in stuck}
    replaced = set(backend.restart_workers(stuck, timeout))
    job.wait(timeout)  # the calls on the old processes end as the engine's errors
    removed = tuple(sorted(slots[w] for w in stuck if w not in replaced))
    why = ""
    if removed:
        membership.distrust(stuck)  # the next cell names the missing ranks, with the remedy
    else:
        try:
            membership.form(replace(membership.options, n=len(backend.worker_ids())))
        except Exception as exc:  # the interrupt's error is the news; this is part of it
            why = f"{type(exc).__name__}: {exc}"
            membership.distrust(stuck)
    return RanksRestarted(tuple(sorted(hosts)), grace, membership.world_size or len(slots),
                          hosts, {slots[w]: names for w, names in held.items()}, removed, why)
