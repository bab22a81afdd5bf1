"""What a rank holds for training, in bytes: parameters, gradients, optimizer state, process.

Worker-only (torch at the top). The optimizers are the ones :mod:`.ddp_hooks` saw step in this
process: their parameter groups name every trained parameter, and their state holds the
optimizer's tensors, so ZeRO's sharded state and FSDP2's sharded parameters are counted as
this rank holds them.
"""

from __future__ import annotations

import os
import resource
import sys
import weakref
from typing import Any, Optional

import torch

from .model import measurements

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


def _bytes(opts: list[torch.optim.Optimizer], models: Any = ()) -> tuple[int, int, int]:
    """Bytes of the parameters, gradients and state of ``opts`` (and of ``models``' own)."""
    params = grads = state = 0
    seen: set[tuple[int, int]] = set()
    for module in models:
        for p in module.parameters():
            params += _add(p, seen)
            grads += _add(p.grad, seen)
    for opt in opts:
        for group in opt.param_groups:
            for p in group["params"]:
                params += _add(p, seen)
                grads += _add(p.grad, seen)
        for per_param in opt.state.values():
            values = per_param.values() if isinstance(per_param, dict) else ()
            for v in values:
                state += _add(v, seen)
    return params, grads, state


def held(opts: Optional[list[torch.optim.Optimizer]] = None) -> dict[str, Any]:
    """Bytes of parameters, gradients and optimizer state held by this rank (of every live
    optimizer that stepped, or of ``opts``), and under ``model`` what ZeRO's memory model
    needs of the optimizers stepped in the running cell (:func:`_model`)."""
    chosen = list(optimizers) if opts is None else opts
    params, grads, state = _bytes(chosen, list(modules) if opts is None else ())
    out: dict[str, Any] = {"params": params, "grads": grads, "optimizer": state}
    cell = chosen if opts is not None else [
        o for o in chosen if o.__dict__.get("_nbdist_cell") == measurements.cells]
    if cell:
        out["model"] = _model(cell)
    return out


def _model(opts: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """For ZeRO's memory model, of ``opts``: their bytes, their parameters' elements in full
    (Ψ: a sharded parameter at its full size), held here and with optimizer state here, and
    how they are split: ``"zero1"`` (a ``ZeroRedundancyOptimizer``: its inner optimizer holds
    the state of this rank's share), ``"fsdp2"`` (every parameter a DTensor sharded on dim 0),
    ``"other"`` (other DTensor layouts: tensor parallel) or ``"none"``."""
    every: dict[int, torch.Tensor] = {}
    stateful: set[int] = set()
    zero = False
    for opt in opts:
        zero = zero or type(opt).__name__ == "ZeroRedundancyOptimizer"
        for group in opt.param_groups:
            for p in group["params"]:
                every.setdefault(id(p), p)
        stateful.update(id(p) for p, per_param in opt.state.items() if per_param)
    full = local = with_state = 0
    placements = set()
    for key, p in every.items():
        part = _local(p)
        full += p.numel()  # a DTensor's numel is its full size
        local += part.numel()
        if key in stateful:
            with_state += part.numel()
        if part is not p:
            placements.add(tuple((type(x).__name__, getattr(x, "dim", None))
                                 for x in getattr(p, "placements", ())))
    sharding = "zero1" if zero else "none"
    if placements:
        sharding = "fsdp2" if placements == {(("Shard", 0),)} else "other"
    params, grads, state = _bytes(opts)
    return {"params": params, "grads": grads, "optimizer": state, "elements": full,
            "local_elements": local, "state_elements": with_state, "sharding": sharding}


_proc: Any = None  # psutil's view of this process (reading its memory: 10 µs; making it: 30)


def _process() -> Any:
    """This process for psutil, made once per process (a worker forked from a template
    makes its own), or None without psutil."""
    global _proc
    if _proc is None or _proc.pid != os.getpid():
        try:
            import psutil
        except ImportError:
            return None
        _proc = psutil.Process()
    return _proc


def probe() -> Optional[dict[str, Any]]:
    """:func:`held` plus the process's resident memory, its peak, and the GPU's peak; None
    once every optimizer that stepped is gone (a model and optimizer local to a function):
    the last sample taken while they lived stands."""
    if not len(optimizers):
        return None
    out: dict[str, Any] = dict(held())
    proc = _process()
    rss = proc.memory_info().rss if proc is not None else None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out["rss"] = rss
    out["peak"] = peak * (1 if sys.platform == "darwin" else 1024)  # Linux reports KiB
    out["device_peak"] = None
    if torch.cuda.is_initialized():  # (it implies is_available(), which costs 20x more)
        out["device_peak"] = torch.cuda.max_memory_allocated()  # since the cell began
    return out


def reset_device_peak() -> None:
    """Start the rank's GPU peak afresh, so each cell reports its own (CUDA keeps the
    process's peak otherwise: a later, smaller cell would show an earlier cell's)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
