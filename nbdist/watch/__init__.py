"""The notebook's side of ``%nbdist attach``: jobs started elsewhere, watched from the kernel.

collector.py listens for the jobs' node forwarders (:mod:`nbdist.agent`); watched.py folds what
they send into each job's record."""
