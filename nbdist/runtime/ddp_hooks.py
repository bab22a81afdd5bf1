"""Patches that feed :mod:`.measure`: DDP's comm hook and ``torch.distributed``'s collectives.

Worker-only: :func:`install` runs once per worker process when it joins the job (the notebook
never imports this module), so torch is imported at the top.

How nbdist's hook composes with yours
-------------------------------------
DDP's reducer takes one communication hook per model, once. So that a user's hook still
applies, nbdist takes that one place and makes it a slot:

1. ``DDP.__init__`` is wrapped so that a model built while telemetry is on goes through
   :func:`_attach`: it gets forward hooks for the step spans, and :func:`_timed_hook` is
   registered as the reducer's hook with a :class:`_HookSlot` as its state. The slot starts
   out holding DDP's default all-reduce hook and the model's process group.
2. ``ddp.register_comm_hook(state, hook)`` on such a model goes to
   :func:`_register_comm_hook`, which runs DDP's own checks and bookkeeping but, instead of
   calling the reducer (which would refuse a second hook), puts ``(hook, state)`` in the slot.
   A second registration still raises DDP's "can only be called once".
   ``_register_builtin_comm_hook`` swaps a C++ hook for its Python twin, which can be timed.
3. For each bucket, :func:`_timed_hook` calls whatever the slot holds and times it from the
   bucket being ready to the returned future completing (:func:`_mark_done`). While a user's
   hook runs, the wrapped collectives charge their bytes to that bucket. With the default in
   the slot it does DDP's all-reduce itself, with a single future callback.

With telemetry off for a cell, :func:`_timed_hook` calls the slot's hook and nothing else;
models built with telemetry off are never hooked at all.
"""

from __future__ import annotations

import functools
import inspect
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from . import memory
from .hang import watch as hang_watch
from .measure import _Bucket, telemetry
from .mesh import dim_of

# The collectives a cell, FSDP2 (all_gather_single, reduce_scatter_single) or ZeRO (broadcast)
# calls through ``torch.distributed``; timed wherever they are looked up at call time.
_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
                "reduce_scatter_single", "all_to_all_single", "all_to_all", "gather", "scatter",
                "barrier")
# send/recv are not here: they call isend/irecv, which parallel_hooks times at their wait().
# What install() replaced, to put back on uninstall(): DDP methods by name, collectives as
# "dist.<name>". Empty means not installed.
_original: dict[str, Callable] = {}
_handles: list[Any] = []  # global optimizer hooks, removed by uninstall()


# ----------------------------------------------------------------- tensor helpers
def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _dtype_name(t: Any) -> str:
    return str(t.dtype)[6:]  # "torch.float16" -> "float16"


def _payload(args: tuple, kwargs: dict) -> tuple[int, str]:
    """Bytes and dtype of a collective: its largest buffer, a tensor or a list of tensors.

    That is the whole tensor of an all-reduce or broadcast, the gathered output of an
    all-gather and the input of a reduce-scatter, as nccl-tests counts them.
    """
    best, dtype = 0, ""
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            n, first = _nbytes(v), v
        elif isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            n, first = sum(_nbytes(t) for t in v), v[0]
        else:
            continue
        if n > best or not dtype:
            best, dtype = max(best, n), str(first.dtype).replace("torch.", "")
    return best, dtype


# ----------------------------------------------------------------- DDP hook composition
class _HookSlot:
    """The hook nbdist registers with DDP's reducer calls whatever hook is in this slot."""

    __slots__ = ("hook", "state", "user")

    def __init__(self, hook: Callable, state: Any):
        self.hook = hook
        self.state = state
        self.user = False  # True once the user registered a hook of their own


def _timed_hook(slot, bucket):  # type: ignore[no-untyped-def]
    """The reducer's comm hook: run the slot's hook on ``bucket`` and time it.

    Records a :class:`~.measure._Bucket` in the open step (opening one if none is open).
    With DDP's default in the slot, averages the bucket and calls the process group's
    all-reduce directly; with a user's hook, calls it with the bucket marked as current so the
    collective wrappers charge their bytes to it. Either way the returned future resolves to
    what the hook's future would have.
    """
    # Unannotated on purpose: DDP rejects hooks whose annotations are not GradBucket/Future.
    tel = telemetry
    if not tel.enabled:
        return slot.hook(slot.state, bucket)
    buf = bucket.buffer()
    rec = _Bucket(bucket.index(), time.time())
    if buf.is_cuda:
        rec.cuda = (torch.cuda.Event(enable_timing=True), None)
        rec.cuda[0].record()
    st = tel.step
    if st is None:
        st = tel.open_step(rec.ready, "ddp")
    st.buckets.append(rec)
    if not slot.user:
        # DDP's default, inlined: one future callback per bucket instead of two.
        group = slot.state if slot.state is not None else dist.group.WORLD
        size = group.size()
        rec.nbytes, rec.dtype, rec.op = _nbytes(buf), _dtype_name(buf), "all_reduce"
        # Average first, as DDP's own hook does, on this (autograd) thread: the callback on the
        # communication thread then does no tensor work, so it holds the GIL only briefly.
        buf.div_(size)
        rec.issued = time.time()
        # The process group's own method: what dist.all_reduce ends in, without its checks.
        fut = group.allreduce([buf]).get_future()

        def reduced(f: Any) -> Any:
            _mark_done(rec)
            return f.value()[0]

        return fut.then(reduced)
    tel.local.bucket = rec
    try:
        fut = slot.hook(slot.state, bucket)
    finally:
        tel.local.bucket = None
    if not rec.op and fut.done():
        # Answered at once without communicating: local SGD's hook after its warm-up.
        rec.op, rec.dtype = "local", _dtype_name(buf)
    elif not rec.op:  # the hook used no torch.distributed call we could see
        rec.nbytes, rec.dtype = _nbytes(buf), _dtype_name(buf)

    def done(f: Any) -> Any:
        _mark_done(rec)
        return f.value()

    return fut.then(done)


def _mark_done(rec: _Bucket) -> None:
    """Mark ``rec``'s communication finished; runs in the hook future's callback.

    On CPU that is now. On CUDA the callback runs once the work is queued on the GPU, not
    finished, so it records an event that completes with the work instead; the step reads it
    when it closes (:func:`~.measure._resolve_cuda`).
    """
    if rec.cuda is not None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()  # on the stream the result is consumed on: completes with the work
        rec.cuda = (rec.cuda[0], end)
    else:
        rec.done = time.time()
    hang_watch.progress()


def _forward_pre(_module: Any, args: tuple) -> None:
    # Evaluation under no_grad is not a training step.
    if telemetry.enabled and torch.is_grad_enabled():
        telemetry.on_forward(args)


def _forward_post(_module: Any, _args: tuple, output: Any) -> None:
    if telemetry.enabled:
        telemetry.on_forward_end(output)


def _attach(ddp: Any) -> None:
    """Time ``ddp``'s steps and buckets (only models built while telemetry is on).

    Called at the end of ``DDP.__init__``. Adds the forward hooks that open steps, then takes
    the reducer's one comm-hook place for :func:`_timed_hook` and a fresh :class:`_HookSlot`
    holding DDP's default all-reduce. Models on the compiled Python reducer, or for which DDP
    already registered a hook itself (mixed precision), get steps only.
    """
    if not telemetry.enabled:
        return
    ddp.register_forward_pre_hook(_forward_pre)
    ddp.register_forward_hook(_forward_post)
    if getattr(ddp, "_use_python_reducer", False) or ddp._comm_hooks:
        return  # compiled reducer, or DDP registered a hook itself: steps only
    slot = _HookSlot(default_hooks.allreduce_hook, ddp.process_group)
    _original["register_comm_hook"](ddp, slot, _timed_hook)
    ddp._nbdist_slot = slot


def _register_comm_hook(self: Any, state: object, hook: Callable) -> None:
    """``DDP.register_comm_hook``: on a hooked model, put ``hook`` in the slot.

    Does what DDP's own method does (check the hook, name it for DDP's logger, remember it in
    ``_comm_hooks``, refuse a second one) except registering with the reducer, which already
    holds :func:`_timed_hook`. Models nbdist did not hook get DDP's method unchanged.
    """
    slot = getattr(self, "_nbdist_slot", None)
    if slot is None:
        return _original["register_comm_hook"](self, state, hook)
    if slot.user:
        raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be "
                           "called once.")
    self._check_comm_hook(hook)
    self.logger._set_comm_hook_name(getattr(hook, "__qualname__", repr(hook)))
    self._comm_hooks.append((hook, state))
    slot.hook, slot.state, slot.user = hook, state, True


def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
    """``DDP._register_builtin_comm_hook``: on a hooked model, use the C++ hook's Python twin.

    ``ALLREDUCE`` and ``FP16_COMPRESS`` become :func:`_register_comm_hook` with DDP's Python
    hook of the same arithmetic; other types, and models nbdist did not hook, go to DDP.
    """
    python_twin = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                   dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
    if getattr(self, "_nbdist_slot", None) is None or comm_hook_type not in python_twin:
        return _original["_register_builtin_comm_hook"](self, comm_hook_type)
    # The C++ hook cannot be wrapped; its Python twin does the same arithmetic and is timed.
    return _register_comm_hook(self, self.process_group, python_twin[comm_hook_type])


# ----------------------------------------------------------------- collectives
def _wrap_collective(name: str, fn: Callable) -> Callable:
    """``fn`` (a ``torch.distributed`` collective) timed, or charged to the running hook."""
    params = list(inspect.signature(fn).parameters)
    async_at = params.index("async_op") if "async_op" in params else None
    group_at = params.index("group") if "group" in params else None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tel = telemetry
        if not tel.enabled:
            return fn(*args, **kwargs)
        rec = getattr(tel.local, "bucket", None)
        if rec is not None:  # inside a DDP hook: this is the bucket's traffic
            nbytes, dtype = _payload(args, kwargs)
            rec.nbytes += nbytes
            rec.dtype, rec.op = dtype, name
            if rec.issued is None:
                rec.issued = time.time()
            return fn(*args, **kwargs)
        if not tel.collectives:
            return fn(*args, **kwargs)
        nbytes, dtype = _payload(args, kwargs)
        is_async = kwargs.get("async_op", False) if async_at is None or len(args) <= async_at \
            else args[async_at]
        group = kwargs.get("group") if group_at is None or len(args) <= group_at \
            else args[group_at]
        dim = dim_of(group)  # the mesh dimension of an explicit group (FSDP2's, a 2-D mesh's)
        t0 = time.time()
        hang_watch.enter(name, nbytes, dtype, t0)  # where the hang doctor finds it
        try:
            work = fn(*args, **kwargs)
        finally:
            hang_watch.leave()
        if is_async and work is not None:
            try:
                work.get_future().then(lambda _f: tel.on_collective(
                    name, t0, time.time(), nbytes, dtype, blocking=False, dim=dim))
            except RuntimeError:  # some works (send/recv on gloo) have no future
                pass
        else:
            tel.on_collective(name, t0, time.time(), nbytes, dtype, blocking=True, dim=dim)
        return work

    wrapper._nbdist_original = fn  # type: ignore[attr-defined]
    return wrapper


# ----------------------------------------------------------------- optimizer steps
def _optimizer_pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # A parameter server's thread steps its optimizer beside the rank's training: not a step.
    if telemetry.enabled and not getattr(telemetry.local, "server", False):
        memory.optimizers.add(optimizer)
        telemetry.on_optimizer_step(begin=True)


def _optimizer_post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if telemetry.enabled and not getattr(telemetry.local, "server", False):
        telemetry.on_optimizer_step(begin=False)


# ----------------------------------------------------------------- install / uninstall
def install() -> None:
    """Patch DDP and ``torch.distributed``'s collectives in this process (idempotent)."""
    if _original:
        return
    _original["__init__"] = init = DDP.__init__
    _original["register_comm_hook"] = DDP.register_comm_hook
    _original["_register_builtin_comm_hook"] = DDP._register_builtin_comm_hook

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _attach(self)

    DDP.__init__ = __init__
    DDP.register_comm_hook = _register_comm_hook
    DDP._register_builtin_comm_hook = _register_builtin_comm_hook
    # Without DDP, optimizer steps are the training steps (FSDP2, ZeRO, plain optimizers).
    _handles.append(register_optimizer_step_pre_hook(_optimizer_pre))
    _handles.append(register_optimizer_step_post_hook(_optimizer_post))
    telemetry.memory_probe = memory.probe
    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None:
            _original[f"dist.{name}"] = fn
            setattr(dist, name, _wrap_collective(name, fn))


def uninstall() -> None:
    """Undo :func:`install` (models already built keep their hooks, which then pass through)."""
    while _handles:
        _handles.pop().remove()
    telemetry.memory_probe = None
    for key, fn in _original.items():
        if key.startswith("dist."):
            setattr(dist, key[5:], fn)
        else:
            setattr(DDP, key, fn)
    _original.clear()
