"""``%nbdist pull`` on a worker: find a value by its dotted name, bring it to the CPU and
pack it for the notebook (:mod:`.packing`), or say why it cannot travel."""

from __future__ import annotations

import copy
from typing import Any, Optional

from ..telemetry.units import fmt_bytes
from . import packing, results


def pull(namespace: dict[str, Any], name: str, sink: Optional[tuple],
         timeout: float) -> list[Any]:
    """``name`` (a dotted path) from the namespace, with tensors and modules on CPU, packed:
    ``[PullResult, header, layout, *buffers]``, or ``[PullResult]`` saying why not. (A flat
    list: the engines send each of its buffers as a frame of its own, without a copy.) With
    ``sink`` (the notebook's data channel's address, the pull's ticket, whether a shared
    copy may be offered, and the fingerprint of the channel's TLS certificate or None where
    it is plain TCP), large buffers go there instead, and the result says so.
    ``timeout`` is the channel's socket timeout, in seconds."""
    parts = name.split(".")
    if parts[0] not in namespace:
        return [results.not_pulled(f"name {parts[0]!r} is not defined on this worker")]
    obj = namespace[parts[0]]
    for attr in parts[1:]:
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            return [results.not_pulled(f"{'.'.join(parts[:parts.index(attr)])} has no "
                                       f"attribute {attr!r}")]
    size = _size_hint(obj)
    if size > MAX_PULL_BYTES:
        return [results.not_pulled(_too_big(name, size))]
    try:
        packed = packing.pack(_to_cpu(obj))
    except Exception as exc:  # the user's object, not nbdist: say what cannot travel
        return [results.not_pulled(
            f"{name} ({type(obj).__name__}) cannot be sent to the notebook: "
            f"{type(exc).__name__}: {exc}. Pull the parts that can be pickled, e.g. a "
            "state_dict() or a tensor")]
    if packed.nbytes > MAX_PULL_BYTES:
        return [results.not_pulled(_too_big(name, packed.nbytes))]
    header, buffers, layout = packed
    if sink is not None and packing.channel_bytes(buffers) >= packing.CHANNEL_MIN:
        address, ticket, shared, tls = sink
        packing.deliver(tuple(address), ticket, buffers, timeout, shared, tls)
        return [results.pulled(channel=True), header, layout]
    return [results.pulled(), header, layout, *buffers]


#: the largest object ``pull`` sends (pickled); bigger ones are refused with their size
MAX_PULL_BYTES = 2 << 30


def _too_big(name: str, size: int) -> str:
    return (f"{name} is {fmt_bytes(size)}, over the {fmt_bytes(MAX_PULL_BYTES)} that pull "
            "sends: pull a part of it (a slice, one tensor), or save it to a file on the "
            "worker (torch.save) and read that")


def _size_hint(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (a tensor, a module, or a dict/list of them), known
    without pickling it."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, torch.nn.Module):
        return sum(t.numel() * t.element_size()
                   for t in (*obj.parameters(), *obj.buffers()))
    if isinstance(obj, dict):
        return sum(_size_hint(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_size_hint(v) for v in obj)
    return 0


def _to_cpu(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
        obj = obj.module
    if isinstance(obj, torch.nn.Module):
        on_cpu = all(t.device.type == "cpu" for t in (*obj.parameters(), *obj.buffers()))
        return obj if on_cpu else copy.deepcopy(obj).cpu()  # the worker's own stays put
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
