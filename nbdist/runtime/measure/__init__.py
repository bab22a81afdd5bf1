"""Measurement on the ranks: what a step, a bucket, a collective and a rank's memory cost.

``model`` is the torch-free record of a cell's measurements (``measurements``) and how each number
is taken; ``ddp_hooks`` and ``parallel_hooks`` patch torch (DDP, collectives, pipelines,
DTensor) to feed it; ``memory``, ``tqdm_bars`` and ``tensors`` are small readers; ``hang`` is the
hang doctor's worker half (where a rank is when no step completes).
"""
