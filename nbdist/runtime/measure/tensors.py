"""How many samples (:func:`batch_size`) and bytes (:func:`payload`) a call's arguments carry,
without importing torch.

Shared by what counts samples on a worker: the measurement model (:mod:`.model`), the
pipeline and tensor-parallel hooks (:mod:`.parallel_hooks`) and the parameter server
(:mod:`.parameter_server`); and by what times collectives (:mod:`.ddp_hooks`,
:mod:`.parallel_hooks`). The notebook imports :mod:`.model` too, and ``import nbdist`` must
not load torch: torch is looked up in ``sys.modules``, where a worker that has tensors has it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
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


def payload(args: Iterable[Any], kwargs: Mapping[str, Any]) -> tuple[int, str]:
    """Bytes and dtype of a collective: its largest buffer, a tensor or a list of tensors.

    That is the whole tensor of an all-reduce or broadcast, the gathered output of an
    all-gather and the input of a reduce-scatter, as nccl-tests counts them.

    Returns
    -------
    tuple of (int, str)
        The buffer's size in bytes and its dtype's name (``"float32"``); ``(0, "")`` when no
        argument is a tensor or a list of them.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return 0, ""  # torch was never imported, so there is no tensor to find
    tensor = torch.Tensor
    best, dtype = 0, ""
    for v in (*args, *kwargs.values()):
        if isinstance(v, tensor):
            n, first = v.numel() * v.element_size(), v
        elif isinstance(v, (list, tuple)) and v and isinstance(v[0], tensor):
            n, first = sum(t.numel() * t.element_size() for t in v), v[0]
        else:
            continue
        if n > best or not dtype:
            best, dtype = max(best, n), str(first.dtype).replace("torch.", "")
    return best, dtype
