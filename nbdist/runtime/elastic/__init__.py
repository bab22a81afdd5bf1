"""Elastic training on the workers, behind ``nbdist.elastic`` (see ``docs/fault-tolerance.md``).

- :mod:`.state`: the user's API, ``State`` (commit, restore, persist) and ``run``;
- :mod:`.protocol`: what workers and the notebook say to each other through the job's store
  (its keys, each membership as a ``Plan``) and how state moves between ranks;
- :mod:`.loop`: an ``elastic.run`` call on one rank: call, fail, re-form, heal, call again.

The notebook's half is :mod:`nbdist.elastic.coordinator`.
"""
