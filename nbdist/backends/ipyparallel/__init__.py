"""The ipyparallel engine: :mod:`.adapter` (the notebook's side), :mod:`.worker` (its half
inside the engines: the event channel, calls by name) and :mod:`.ssh` (hosts over SSH).

The package imports nothing: engines import :mod:`.worker` without the notebook's side.
"""
