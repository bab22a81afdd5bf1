"""The job's side of ``%nbdist attach``: what a job started outside the notebook (torchrun,
``srun``, ``mpirun``) runs to report to it. Stdlib, torch and nbdist's worker runtime only;
never IPython. See :mod:`.hook` for how a process starts reporting."""
