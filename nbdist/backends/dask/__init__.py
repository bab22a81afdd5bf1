"""The Dask engine: :mod:`.adapter` (the notebook's side), :mod:`.worker` (its half inside the
workers), :mod:`.elsewhere` (clusters a launcher starts), :mod:`.ssh`, :mod:`.nanny`, :mod:`.logs`.

The package imports nothing: workers import :mod:`.worker` without the notebook's side.
"""
