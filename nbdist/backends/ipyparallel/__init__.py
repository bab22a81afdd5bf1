"""The ipyparallel engine: :mod:`.adapter` (the notebook's side), :mod:`.worker` (its half
inside the engines: the event channel, calls by name), :mod:`.launchers` (ipyparallel's own
launchers and their settings), :mod:`.template` (engines forked from the worker template) and
:mod:`.ssh` (hosts over SSH).

The package imports nothing: engines import :mod:`.worker` without the notebook's side.
"""
