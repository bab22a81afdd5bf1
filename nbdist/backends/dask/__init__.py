"""The Dask engine: :mod:`.adapter` (the notebook's side), :mod:`.worker` (its half inside the
workers), :mod:`.submission` (calls in flight on the workers' runners), :mod:`.launchers` (the
cluster class for a launcher, the setting its workers start under), :mod:`.elsewhere` (clusters
a launcher starts), :mod:`.forkserver` (the worker template of a local cluster), :mod:`.ssh`,
:mod:`.nanny`, :mod:`.logs`.

The package imports nothing: workers import :mod:`.worker` without the notebook's side.
"""
