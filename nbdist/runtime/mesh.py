"""``nbdist.mesh()``: the job's ``DeviceMesh``, for FSDP2, tensor and pipeline parallelism.

Called inside a ``%%distributed`` cell on every rank (making a mesh is collective). The mesh
is torch's own (``init_device_mesh``); nbdist only picks the device type, checks the shape
against the world size, and keeps one mesh per shape until the process group is re-formed.

It also remembers which process group serves which named dimension of every mesh made in
this process (:func:`remember`, called when a ``DeviceMesh`` is built), so telemetry can say
which dimension a collective ran on (:func:`dim_of`).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Optional

_cache: dict[tuple, Any] = {}
#: process group name -> the mesh dimension it serves (the latest mesh made wins: a 1-D mesh
#: over every rank and a 2-D mesh's full-width dimension share the default group)
_dims: dict[str, str] = {}


def mesh(*shape: int, names: Optional[tuple[str, ...]] = None, **named: int) -> Any:
    """The job's device mesh: 1-D over every rank by default, or a named N-D shape.

    Examples
    --------
    >>> m = nbdist.mesh()                  # doctest: +SKIP
    >>> m = nbdist.mesh(dp=2, tp=2)        # 2-D: data x tensor parallel, 4 ranks
    >>> m["tp"]                            # doctest: +SKIP

    Raises
    ------
    RuntimeError
        Called outside a ``%%distributed`` cell (no process group).
    TypeError
        Both a named shape and ``shape`` or ``names`` are given.
    ValueError
        ``names`` and ``shape`` differ in length, or the shape's ranks are not the job's.
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
    device = group.device_type()  # the ranks' device: CUDA also where ranks share a GPU (gloo)
    key = (group.generation(), device, tuple(shape), names)
    if key not in _cache:
        _cache.clear()  # meshes of an earlier group are unusable
        _cache[key] = init_device_mesh(device, tuple(shape), mesh_dim_names=names)
    return _cache[key]


def remember(device_mesh: Any) -> None:
    """Note the groups of ``device_mesh``'s dimensions under their names (``dim0``... if
    unnamed)."""
    groups = getattr(device_mesh, "_dim_group_names", None)
    if not groups:
        return
    names = device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(len(groups)))
    for group_name, dim in zip(groups, names):
        _dims[str(group_name)] = dim


def dim_of(group: Any) -> Optional[str]:
    """The mesh dimension that ``group`` serves: a ``(mesh, dim)`` pair or a 1-D mesh as
    functional collectives take them, a ``ProcessGroup`` or its name; None when unknown."""
    if group is None:
        return None
    if isinstance(group, tuple) and len(group) == 2 and hasattr(group[0], "mesh_dim_names"):
        mesh_, dim = group
        if isinstance(dim, str):
            return dim
        names = mesh_.mesh_dim_names
        return names[dim] if names else f"dim{dim}"
    if hasattr(group, "mesh_dim_names"):  # a DeviceMesh
        names = group.mesh_dim_names
        return names[0] if names and len(names) == 1 else None
    name = group if isinstance(group, str) else getattr(group, "group_name", None)
    if name is None or _is_default(str(name)):
        # Every rank's group serves any mesh spanning all ranks: naming it after the latest
        # such mesh would mislabel plain collectives (model averaging's all-reduce).
        return None
    return _dims.get(str(name))


def _is_default(name: str) -> bool:
    dist = sys.modules.get("torch.distributed")  # a worker with groups has it loaded
    return dist is not None and dist.is_initialized() and dist.group.WORLD.group_name == name
