"""Processes nbdist starts beside the engines' own: ``lifeline`` (a worker or controller ends
with the kernel that started it), ``preload`` (an engine imports torch while it registers) and
``store_host`` (the job's rendezvous store, a child of the kernel, never of a worker).
"""
