"""Worker-only timing of model parallelism: pipeline stages and their transfers, DTensor's
collectives, and the mesh dimension each collective ran on.

:func:`install` (when a worker joins) patches what torch has already imported:

* ``torch.distributed.isend`` / ``irecv`` (and the same names in ``distributed_c10d``, which
  ``P2POp`` and ``batch_isend_irecv`` compare against): the returned work is wrapped so the
  transfer is timed from the call to the end of its ``wait()``. Gloo's point-to-point works
  have no future, so ``wait()`` is the only place their completion is seen.
* ``DeviceMesh.__init__``: every mesh's dimension names are remembered by process group
  (:func:`nbdist.runtime.mesh.remember`), so collectives called with a group name a dimension.

Three modules are heavy to import (about 2 s together), so they are patched when a cell first
imports them, by a post-import hook on ``sys.meta_path`` (:class:`_PostImport`):

* ``torch.distributed.pipelining.stage`` / ``.schedules``: each stage's
  ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk`` is timed per
  microbatch; the ``get_*_ops`` methods tag the tensors they hand to ``P2POp`` with the
  microbatch (``F3``: activations of microbatch 3, ``B3``: their gradients); a schedule's
  ``step()`` reports its span, compute and waits (:meth:`.model.Measurements.on_pipeline_step`)
  and, on the first stage, the batch as samples.
* ``torch.distributed._functional_collectives``: DTensor issues its collectives through these
  functions (not ``torch.distributed.*``) and waits on the result at first use through
  ``wait_tensor``. Each is timed from issue to the end of that wait, with the dimension of the
  ``(mesh, dim)`` it was given.
* ``torch.distributed.tensor.parallel.api.parallelize_module``: the first module
  parallelized in a cell counts each forward's batch as samples, divided by the mesh size
  (the ranks of a tensor-parallel group share one batch).
* FSDP2's per-state root pre-forward: the root module's forward (the one FSDP makes the
  iteration's root) counts its batch as samples.

Under ``torch.compile`` tracing every wrapper steps aside. With telemetry off for a cell the
wrappers only call through.
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import sys
import time
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from ..mesh import dim_of, remember
from .model import measurements
from .tensors import batch_size, payload

# What install() replaced: (owner, attribute) -> original, put back by uninstall().
_original: dict[tuple[Any, str], Any] = {}
# id(tensor handed to a P2POp) -> its microbatch label; filled by the stage's get_*_ops
_p2p_tags: dict[int, str] = {}
# storage address of a functional collective's pending result -> what to report at its wait
_pending: dict[int, tuple] = {}
_MAX_PENDING = 1024  # results nobody waited on are forgotten past this many


def _patch(owner: Any, name: str, wrapper: Callable) -> None:
    if (owner, name) not in _original:
        _original[(owner, name)] = getattr(owner, name)
    setattr(owner, name, wrapper)


def _tracing() -> bool:
    return torch.compiler.is_compiling()


# ----------------------------------------------------------------- post-import hook
class _PostImport(importlib.abc.MetaPathFinder):
    """Runs callbacks on a module right after it is first imported (lazy patching)."""

    def __init__(self) -> None:
        self.hooks: dict[str, list[Callable[[Any], None]]] = {}

    def when_imported(self, name: str, fn: Callable[[Any], None]) -> None:
        module = sys.modules.get(name)
        if module is not None:
            _safely(fn, module)
        else:
            self.hooks.setdefault(name, []).append(fn)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module
        callbacks = self.hooks.pop(name)

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            for fn in callbacks:
                _safely(fn, module)

        loader.exec_module = exec_and_patch  # this spec's own loader instance
        return spec


def _safely(fn: Callable[[Any], None], module: Any) -> None:
    try:
        fn(module)
    except Exception as exc:  # a telemetry patch must never break the user's import
        sys.__stderr__.write(f"nbdist: could not instrument {module.__name__}: {exc!r}\n")


_finder = _PostImport()


# ----------------------------------------------------------------- point-to-point
class _TimedWork:
    """A send's or receive's work; reports the transfer when ``wait()`` returns."""

    __slots__ = ("_work", "_rec")

    def __init__(self, work: Any, rec: tuple) -> None:
        self._work = work
        self._rec: Optional[tuple] = rec

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        t = time.time()
        out = self._work.wait(*args, **kwargs)
        rec, self._rec = self._rec, None
        if rec is not None:
            now = time.time()
            op, t0, nbytes, dtype, peer, mb = rec
            measurements.on_collective(op, t0, now, nbytes, dtype, blocking=False,
                                    exposed_s=now - t, peer=peer, mb=mb)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _wrap_p2p(op: str, fn: Callable, peer_arg: str, group_peer_arg: str) -> Callable:
    """``dist.isend`` / ``dist.irecv`` returning a :class:`_TimedWork`."""

    @functools.wraps(fn)
    def wrapper(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        meas = measurements
        if not meas.enabled or not meas.collectives or _tracing():
            return fn(tensor, *args, **kwargs)
        t0 = time.time()
        work = fn(tensor, *args, **kwargs)
        if work is None:
            return None
        peer = kwargs.get(peer_arg, args[0] if args else None)
        if peer is None and kwargs.get(group_peer_arg) is not None:
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            peer = dist.get_global_rank(group or dist.group.WORLD, kwargs[group_peer_arg])
        rec = (op, t0, tensor.numel() * tensor.element_size(), str(tensor.dtype)[6:], peer,
               _p2p_tags.pop(id(tensor), None))
        return _TimedWork(work, rec)

    wrapper._nbdist_original = fn  # type: ignore[attr-defined]
    return wrapper


# ----------------------------------------------------------------- pipelining
def _timed_chunk(op: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(self: Any, chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if not measurements.enabled or _tracing():
            return fn(self, chunk_id, *args, **kwargs)
        t0 = time.time()
        out = fn(self, chunk_id, *args, **kwargs)
        measurements.on_stage(op, chunk_id, self.stage_index, t0, time.time())
        return out

    return wrapper


def _tagging(label: str, fn: Callable) -> Callable:
    """A stage's ``get_*_ops(chunk_id)``: remember which microbatch each op's tensor is."""

    @functools.wraps(fn)
    def wrapper(self: Any, chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        ops = fn(self, chunk_id, *args, **kwargs)
        if measurements.enabled:
            if len(_p2p_tags) > _MAX_PENDING:
                _p2p_tags.clear()
            for op in ops:
                _p2p_tags[id(op.tensor)] = f"{label}{chunk_id}"
        return ops

    return wrapper


def _timed_schedule_step(fn: Callable) -> Callable:
    """A schedule's ``step()``: a pipeline step on this rank, and the batch as samples."""

    @functools.wraps(fn)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        meas = measurements
        if not meas.enabled or _tracing() or not getattr(self, "_has_backward", True):
            return fn(self, *args, **kwargs)
        stages = getattr(self, "_stages", None) or [self._stage]
        first = any(s.is_first for s in stages)
        meas.count_samples(batch_size(args) if first else 0)  # later stages: same samples
        meas.begin_pipeline_step()
        t0 = time.time()
        out = fn(self, *args, **kwargs)
        meas.on_pipeline_step(t0, time.time(), schedule=type(self).__name__,
                             stages=[s.stage_index for s in stages],
                             num_stages=stages[0].num_stages,
                             microbatches=self._n_microbatches)
        return out

    return step


def _instrument_stage(module: Any) -> None:
    base = module._PipelineStageBase
    for name, op in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                     ("backward_weight_one_chunk", "weight")):
        if hasattr(base, name):
            _patch(base, name, _timed_chunk(op, getattr(base, name)))
    for name, label in (("get_fwd_recv_ops", "F"), ("get_fwd_send_ops", "F"),
                        ("get_bwd_recv_ops", "B"), ("get_bwd_send_ops", "B")):
        if hasattr(base, name):
            _patch(base, name, _tagging(label, getattr(base, name)))


def _instrument_schedules(module: Any) -> None:
    for cls_name in ("PipelineScheduleSingle", "PipelineScheduleMulti"):
        cls = getattr(module, cls_name, None)
        if cls is not None and "step" in cls.__dict__:
            _patch(cls, "step", _timed_schedule_step(cls.__dict__["step"]))


# ----------------------------------------------------------------- functional collectives
# name -> how its payload is counted: the input, or the gathered output
_FUNCOL = {"all_reduce": "in", "all_gather_single": "out", "reduce_scatter_single": "in",
           "all_to_all_single": "in", "broadcast": "in", "all_reduce_coalesced": "in",
           "all_gather_into_tensor_coalesced": "out", "reduce_scatter_tensor_coalesced": "in"}


def _storage_key(t: Any) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, AttributeError):
        return None


def _wrap_funcol(name: str, fn: Callable, act: type) -> Callable:
    """A functional collective: timed from issue to the wait on its result (or to return)."""
    params = list(inspect.signature(fn).parameters)
    group_at = params.index("group") if "group" in params else None
    counts_output = _FUNCOL[name] == "out"

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        meas = measurements
        if not meas.enabled or not meas.collectives or _tracing():
            return fn(*args, **kwargs)
        group = kwargs.get("group") if group_at is None or len(args) <= group_at \
            else args[group_at]
        t0 = time.time()
        out = fn(*args, **kwargs)
        nbytes, dtype = payload(args[:1], {})
        if counts_output:
            nbytes = max(nbytes, payload((out,), {})[0])
        rec = (name, t0, nbytes, dtype, dim_of(group))
        results = out if isinstance(out, (list, tuple)) else (out,)
        waiting = [r for r in results if isinstance(r, act) and not r.completed]
        if not waiting:  # already complete (waited inside, or traced)
            meas.on_collective(name, t0, time.time(), nbytes, dtype, blocking=True,
                              dim=rec[4])
            return out
        if len(_pending) > _MAX_PENDING:
            _pending.clear()
        key = _storage_key(waiting[-1].elem)  # a coalesced call is done when its last is
        if key is not None:
            _pending[key] = rec
        return out

    wrapper._nbdist_original = fn  # type: ignore[attr-defined]
    return wrapper


def _wrap_wait(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wait_tensor(tensor: Any) -> Any:
        if not _pending or _tracing():
            return fn(tensor)
        rec = _pending.pop(_storage_key(tensor), None)
        if rec is None:
            return fn(tensor)
        t = time.time()
        out = fn(tensor)
        now = time.time()
        name, t0, nbytes, dtype, dim = rec
        measurements.on_collective(name, t0, now, nbytes, dtype, blocking=False,
                                exposed_s=now - t, dim=dim)
        return out

    return wait_tensor


def _instrument_funcol(module: Any) -> None:
    for name in _FUNCOL:
        fn = getattr(module, name, None)
        if fn is not None:
            _patch(module, name, _wrap_funcol(name, fn, module.AsyncCollectiveTensor))
    _patch(module, "wait_tensor", _wrap_wait(module.wait_tensor))


# ----------------------------------------------------------------- tensor parallel samples
_counting: Optional[weakref.ref] = None  # the module whose forwards count samples
_counting_cell = -1


def _count_forward(mesh_size: int) -> Callable:
    def pre_hook(module: Any, args: tuple) -> None:
        if measurements.enabled and _counting is not None and _counting() is module \
                and torch.is_grad_enabled():
            measurements.count_samples(batch_size(args) / mesh_size)

    return pre_hook


def _wrap_parallelize(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def parallelize_module(module: Any, device_mesh: Any = None, *args: Any,
                           **kwargs: Any) -> Any:
        global _counting, _counting_cell
        first = measurements.enabled and _counting_cell != measurements.cells
        if first:  # the outermost call of this cell (the plan recurses through this name)
            _counting_cell = measurements.cells
            _counting = weakref.ref(module)
        out = fn(module, device_mesh, *args, **kwargs)
        if first:
            mesh_ = device_mesh
            if mesh_ is None:
                from torch.distributed.device_mesh import _mesh_resources

                mesh_ = _mesh_resources.get_current_mesh()
            if not getattr(module, "_nbdist_counts", False) and mesh_.ndim == 1:
                module.register_forward_pre_hook(_count_forward(mesh_.size()))
                module._nbdist_counts = True
        return out

    return parallelize_module


def _instrument_tp(module: Any) -> None:
    _patch(module, "parallelize_module", _wrap_parallelize(module.parallelize_module))


# ----------------------------------------------------------------- FSDP2 samples
def _counting_root(fn: Callable) -> Callable:
    """``FSDPState._root_pre_forward``: every FSDP module's first forward of an iteration calls
    it, and it makes the first one the iteration's root; that module's batch is the samples."""

    @functools.wraps(fn)
    def _root_pre_forward(self: Any, module: Any, args: tuple, kwargs: dict) -> Any:
        ctx = getattr(self, "_state_ctx", None)
        before = getattr(ctx, "iter_forward_root", None)
        out = fn(self, module, args, kwargs)
        if measurements.enabled and before is not self and torch.is_grad_enabled() \
                and getattr(getattr(self, "_state_ctx", None), "iter_forward_root", None) is self:
            measurements.count_samples(batch_size(args) or batch_size(kwargs.values()))
        return out

    return _root_pre_forward


def _instrument_fsdp(module: Any) -> None:
    state = module.FSDPState
    if "_root_pre_forward" in state.__dict__:
        _patch(state, "_root_pre_forward", _counting_root(state.__dict__["_root_pre_forward"]))


# ----------------------------------------------------------------- install / uninstall
def _remembering_init(init: Callable) -> Callable:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        try:
            remember(self)
        except Exception:  # naming is a nicety; a mesh must build regardless
            pass

    return __init__


def install() -> None:
    """Patch point-to-point, meshes, and (on import) pipelining, DTensor's collectives and
    ``parallelize_module`` in this process (idempotent)."""
    if _original:
        return
    send = _wrap_p2p("send", c10d.isend, "dst", "group_dst")
    recv = _wrap_p2p("recv", c10d.irecv, "src", "group_src")
    # P2POp and batch_isend_irecv compare ops against c10d's names: both modules get the same
    for module in (dist, c10d):
        _patch(module, "isend", send)
        _patch(module, "irecv", recv)
    _patch(DeviceMesh, "__init__", _remembering_init(DeviceMesh.__init__))
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    _finder.when_imported("torch.distributed.pipelining.stage", _instrument_stage)
    _finder.when_imported("torch.distributed.pipelining.schedules", _instrument_schedules)
    _finder.when_imported("torch.distributed._functional_collectives", _instrument_funcol)
    _finder.when_imported("torch.distributed.tensor.parallel.api", _instrument_tp)
    _finder.when_imported("torch.distributed.fsdp._fully_shard._fsdp_state", _instrument_fsdp)


def uninstall() -> None:
    """Undo :func:`install`."""
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder.hooks.clear()
    for (owner, name), fn in _original.items():
        setattr(owner, name, fn)
    _original.clear()
    _p2p_tags.clear()
    _pending.clear()
