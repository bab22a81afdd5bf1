"""Elastic training in a notebook: a worker dies, the cell carries on from the last commit.

Used in a ``%%distributed`` cell::

    state = nbdist.elastic.State(model=model, optimizer=opt, step=0)

    @nbdist.elastic.run
    def train(state):
        while state.step < 100:
            ...                      # one step with state.model / state.optimizer
            state.step += 1
            state.commit()           # a consistent point to come back to

    train(state)

When a rank dies or a collective fails inside ``train``, the ranks that are left leave the
failed collective, form a new process group among themselves in the same warm processes, roll
back to the last commit and call ``train(state)`` again from the top; on a cluster nbdist
started, a replacement worker joins at a later commit (every member then starts ``train`` again
from that commit) and receives the committed state, the function and the cell's names from a
live peer over the process group. See ``docs/fault-tolerance.md``.

Healing copies one rank's committed state to the others, so the state must be replicated
(data parallel: DDP, or plain collectives), not sharded. Outside nbdist (e.g. the same code
under ``torchrun``) ``State`` and ``run`` work as plain objects: commits and persistence
happen, recovery does not.

This module names the API; the code runs on the workers, in :mod:`nbdist.runtime.elastic`.
"""

from __future__ import annotations

from ..runtime.elastic.protocol import ElasticError
from ..runtime.elastic.state import ElasticFunction, State, run

__all__ = ["State", "run", "ElasticError", "ElasticFunction"]
