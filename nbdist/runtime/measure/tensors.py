"""How many samples a call's arguments carry, without importing torch.

Shared by what counts samples on a worker: the measurement model (:mod:`.measure`), the
pipeline and tensor-parallel hooks (:mod:`.parallel_hooks`) and the parameter server
(:mod:`.parameter_server`). The notebook imports :mod:`.measure` too, and ``import nbdist`` must
not load torch: torch is looked up in ``sys.modules``, where a worker that has tensors has it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any


def batch_size(args: Iterable[Any]) -> int:
    """The leading dimension of the first tensor found in ``args``, looking into the first
    item of lists, tuples and dicts (0 when there is none; 1 for a scalar tensor)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0  # torch was never imported, so there is no tensor to find
    return _leading_dim(args, torch.Tensor)


def _leading_dim(args: Iterable[Any], tensor: type) -> int:
    for a in args:
        if isinstance(a, tensor):
            return int(a.shape[0]) if a.dim() else 1
        if isinstance(a, (list, tuple)) and a and not hasattr(a, "_fields"):
            n = _leading_dim(a[:1], tensor)
            if n:
                return n
        if isinstance(a, dict) and a:
            n = _leading_dim(list(a.values())[:1], tensor)
            if n:
                return n
    return 0
