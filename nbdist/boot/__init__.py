"""The notebook's handles on the processes :mod:`nbdist.runtime.boot` runs: the rendezvous
store's host process (:mod:`.store_host`) and the worker template (:mod:`.template`).

Used by both :mod:`nbdist.backends` and :mod:`nbdist.group`, so it sits below them.
"""
