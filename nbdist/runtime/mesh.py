"""``nbdist.mesh()``: the job's ``DeviceMesh``, for FSDP2, tensor and pipeline parallelism.

Called inside a ``%%distributed`` cell on every rank (making a mesh is collective). The mesh
is torch's own (``init_device_mesh``); nbdist only picks the device type, checks the shape
against the world size, and keeps one mesh per shape until the process group is re-formed.
"""

from __future__ import annotations

import math
from typing import Any, Optional

_cache: dict[tuple, Any] = {}


def mesh(*shape: int, names: Optional[tuple[str, ...]] = None, **named: int) -> Any:
    """The job's device mesh: 1-D over every rank by default, or a named N-D shape.

    Examples
    --------
    >>> m = nbdist.mesh()                  # doctest: +SKIP
    >>> m = nbdist.mesh(dp=2, tp=2)        # 2-D: data x tensor parallel, 4 ranks
    >>> m["tp"]                            # doctest: +SKIP
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from . import group

    if not dist.is_initialized():
        raise RuntimeError("nbdist.mesh() needs the process group: call it in a %%distributed "
                           "cell")
    world = dist.get_world_size()
    if named and (shape or names):
        raise TypeError("give the mesh as mesh(dp=2, tp=2) or as mesh(2, 2, names=...), "
                        "not both")
    if named:
        names, shape = tuple(named), tuple(named.values())
    if not shape:
        shape, names = (world,), names or ("dp",)
    if names is not None and len(names) != len(shape):
        raise ValueError(f"mesh shape {shape} has {len(shape)} dimensions but {len(names)} "
                         "names")
    if math.prod(shape) != world:
        raise ValueError(f"a mesh of shape {tuple(shape)} needs {math.prod(shape)} ranks; this "
                         f"job has {world}")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    key = (group.generation(), device, tuple(shape), names)
    if key not in _cache:
        _cache.clear()  # meshes of an earlier group are unusable
        _cache[key] = init_device_mesh(device, tuple(shape), mesh_dim_names=names)
    return _cache[key]
