"""What a rank holds for training, in bytes: parameters, gradients, optimizer state, process.

Worker-only (torch at the top). The optimizers are the ones :mod:`.ddp_hooks` saw step in this
process: their parameter groups name every trained parameter, and their state holds the
optimizer's tensors, so ZeRO's sharded state and FSDP2's sharded parameters are counted as
this rank holds them.
"""

from __future__ import annotations

import resource
import sys
import weakref
from typing import Any, Optional

import torch

#: optimizers stepped in this process (ZeRO's wrapper and its inner optimizer both)
optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
#: models trained without a local optimizer (a parameter server's workers)
modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` stored on this rank (a DTensor's local shard)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _add(t: Any, seen: set[tuple[int, int]]) -> int:
    """Bytes of ``t``'s local part, once per tensor (the same tensor in two optimizers counts
    once; views into one buffer, as model averaging leaves parameters, count each)."""
    if not isinstance(t, torch.Tensor):
        return 0
    local = _local(t)
    try:
        key = (local.data_ptr(), local.numel())
    except RuntimeError:  # tensors without storage (meta, some wrappers)
        return 0
    if key in seen:
        return 0
    seen.add(key)
    return local.numel() * local.element_size()


def held(opts: Optional[list[torch.optim.Optimizer]] = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank."""
    params = grads = state = 0
    seen: set[tuple[int, int]] = set()
    for module in list(modules) if opts is None else ():
        for p in module.parameters():
            params += _add(p, seen)
            grads += _add(p.grad, seen)
    for opt in list(optimizers) if opts is None else opts:
        for group in opt.param_groups:
            for p in group["params"]:
                params += _add(p, seen)
                grads += _add(p.grad, seen)
        for per_param in opt.state.values():
            values = per_param.values() if isinstance(per_param, dict) else ()
            for v in values:
                state += _add(v, seen)
    return {"params": params, "grads": grads, "optimizer": state}


def probe() -> Optional[dict[str, Any]]:
    """:func:`held` plus the process's resident memory, its peak, and the GPU's peak; None
    once every optimizer that stepped is gone (a model and optimizer local to a function):
    the last sample taken while they lived stands."""
    if not len(optimizers):
        return None
    out: dict[str, Any] = dict(held())
    rss = None
    try:
        import psutil

        rss = psutil.Process().memory_info().rss
    except ImportError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out["rss"] = rss
    out["peak"] = peak * (1 if sys.platform == "darwin" else 1024)  # Linux reports KiB
    out["device_peak"] = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["device_peak"] = torch.cuda.max_memory_allocated()  # since the cell began
    return out


def reset_device_peak() -> None:
    """Start the rank's GPU peak afresh, so each cell reports its own (CUDA keeps the
    process's peak otherwise: a later, smaller cell would show an earlier cell's)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
