"""Patches that feed :mod:`.model`: DDP's comm hook and ``torch.distributed``'s collectives.

Worker-only: :func:`install` runs once per worker process when it joins the job (the notebook
never imports this module), so torch is imported at the top.

How a model's steps are timed
-----------------------------
``DDP.__init__`` is wrapped so that a model built while telemetry is on goes through
:func:`_attach`, which adds forward hooks for the step spans and then times the gradient
all-reduce in one of two ways.

**DDP's own timer (CPU models on DDP's default all-reduce).** DDP's reducer can time every
iteration itself, in C++: when its buckets' compute ended and when the first all-reduce
started and the last one was waited for. It does so on sampled iterations only; nbdist sets the
sample rate to every iteration and reads the times after DDP stored them at the next forward
(:class:`_DDPTimer`). Nothing of nbdist runs per bucket, so gradients keep DDP's fused
averaging and no Python runs inside autograd: a Python comm hook that did the same cost about
5 % of a small model's step. A step then reports one all-reduce span and the buckets' bytes. On
CUDA, DDP's timer synchronizes the previous iteration's events, so GPU models use the hook
below instead.

**A timed comm hook (GPU models, models built with bucket timing on, and any model with a hook
of the user's).** DDP's reducer
takes one communication hook per model, once. So that a user's hook still applies, nbdist
takes that one place and makes it a slot:

1. :func:`_timed_hook` is registered as the reducer's hook with a :class:`_HookSlot` as its
   state: on a GPU model at once, holding DDP's default all-reduce hook and the model's
   process group; on a CPU model when the user registers a hook of their own.
2. ``ddp.register_comm_hook(state, hook)`` on such a model goes to
   :func:`_register_comm_hook`, which runs DDP's own checks and bookkeeping but, instead of
   calling the reducer (which would refuse a second hook), puts ``(hook, state)`` in the slot.
   A second registration still raises DDP's "can only be called once".
   ``_register_builtin_comm_hook`` swaps FP16_COMPRESS's C++ hook for its Python twin, which
   can be timed (ALLREDUCE's stays in C++ where DDP's timer times it).
3. For each bucket, :func:`_timed_hook` calls whatever the slot holds and times it from the
   bucket being ready to the returned future completing (:func:`_mark_done`). While a user's
   hook runs, the wrapped collectives charge their bytes to that bucket. With the default in
   the slot it does DDP's all-reduce itself, with a single future callback.

With telemetry off for a cell, :func:`_timed_hook` calls the slot's hook and nothing else, and
DDP's timer is not read; models built with telemetry off are never hooked at all.
"""

from __future__ import annotations

import functools
import inspect
import time
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from .. import faults
from ..mesh import dim_of
from . import memory, tuning
from .model import measurements
from .stall_probe import watch
from .steps import Bucket, DDPTimes
from .tensors import payload

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


# ----------------------------------------------------------------- DDP hook composition
class _HookSlot:
    """The hook nbdist registers with DDP's reducer calls whatever hook is in this slot."""

    __slots__ = ("hook", "state", "user", "chosen")

    def __init__(self, hook: Callable, state: Any):
        self.hook = hook
        self.state = state
        self.user = False  # True once a hook other than DDP's default is in it
        self.chosen = False  # ... and that hook is the session's setting's: the cell's replaces it

    def __reduce__(self) -> tuple:
        # A pickled or deep-copied model gets a reducer of its own, which nbdist never
        # hooked: the copy holds no slot (the live one holds a process group, which does
        # not pickle), as a model built without nbdist holds no hook.
        return _detached, ()


def _detached() -> None:
    """What nbdist's per-model state (a slot, a timer) becomes in a copy of its model."""
    return None


def _timed_hook(slot, bucket):  # type: ignore[no-untyped-def]
    """The reducer's comm hook: run the slot's hook on ``bucket`` and time it.

    Records a :class:`~.steps.Bucket` in the open step (opening one if none is open).
    With DDP's default in the slot, averages the bucket and calls the process group's
    all-reduce directly; with a user's hook, calls it with the bucket marked as current so the
    collective wrappers charge their bytes to it. Either way the returned future resolves to
    what the hook's future would have.
    """
    # Unannotated on purpose: DDP rejects hooks whose annotations are not GradBucket/Future.
    meas = measurements
    if not meas.enabled:
        return slot.hook(slot.state, bucket)
    buf = bucket.buffer()
    rec = Bucket(bucket.index(), time.time())
    if buf.is_cuda:
        rec.cuda = (torch.cuda.Event(enable_timing=True), None)
        rec.cuda[0].record()
    st = meas.step
    if st is None:
        st = meas.open_step(rec.ready, "ddp")
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
    meas.local.bucket = rec
    try:
        fut = slot.hook(slot.state, bucket)
    finally:
        meas.local.bucket = None
    if not rec.op and fut.done():
        # Answered at once without communicating: local SGD's hook after its warm-up.
        rec.op, rec.dtype = "local", _dtype_name(buf)
    elif not rec.op:  # the hook used no torch.distributed call we could see
        rec.nbytes, rec.dtype = _nbytes(buf), _dtype_name(buf)

    def done(f: Any) -> Any:
        _mark_done(rec)
        return f.value()

    return fut.then(done)


def _mark_done(rec: Bucket) -> None:
    """Mark ``rec``'s communication finished; runs in the hook future's callback.

    On CPU that is now. On CUDA the callback runs once the work is queued on the GPU, not
    finished, so it records an event that completes with the work instead; the step reads it
    when it closes (:func:`~.steps.resolve_cuda`).
    """
    if rec.cuda is not None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()  # on the stream the result is consumed on: completes with the work
        rec.cuda = (rec.cuda[0], end)
    else:
        rec.done = time.time()
    watch.progress()


#: DDP's timer times at most one step in this many seconds (every step that takes longer):
#: a timed iteration costs DDP about 0.2-0.5 ms of CPU (its C++ timer and logging, measured on
#: a 784-512-512-10 MLP), 2-5 % of an 11 ms step timed every time; this keeps it under 0.5 %.
TIMED_EVERY_S = 0.2


class _DDPTimer:
    """Reads a CPU model's last synced iteration from DDP's own timer (see the module doc).

    DDP times its first ten iterations, then every ``rate``-th (its runtime-logging sample
    rate; ``should_collect_runtime_stats`` in its reducer). Timing one iteration costs DDP
    0.2-0.5 ms of CPU (reading it here: 5 µs), so :meth:`pace` sets the rate to time about one
    step every :data:`TIMED_EVERY_S` (a power of two of steps): every step of a model whose
    steps take longer, a sample of short ones. The other steps go out
    with their bytes and without an all-reduce span (``comm_timed=False``);
    ``--bucket-timing`` times them all.
    """

    __slots__ = ("ddp", "last_end", "nbytes", "rebuilt", "buckets", "dtype", "iterations",
                 "rate", "paced")

    def __init__(self, ddp: Any):
        # Weakly: the model holds its timer, and a step being sent may too. A strong reference
        # would keep a model the cell dropped (and its reducer, whose hooks on the parameters
        # then fire in a new model's backward) alive until the garbage collector runs.
        self.ddp = weakref.ref(ddp)
        self.iterations = 0  # forwards that sync: DDP's reducer counts the same ones
        self.rate = 1
        self.paced = (0.0, 0)  # when pace() last ran, and the iteration count then
        self.last_end = 0  # the iteration read last (its all-reduce's end, ns): never twice
        # Every parameter that needs a gradient is in a bucket, whatever the bucketing.
        self.nbytes = sum(_nbytes(p) for p in ddp.module.parameters() if p.requires_grad)
        self.rebuilt = -1  # DDP's has_rebuilt_buckets when the buckets were counted
        self.buckets = 0
        self.dtype = ""

    def __call__(self, final: bool, iteration: int) -> Optional[DDPTimes]:
        """The times DDP stored at the last forward for ``iteration``, or None where DDP did
        not time it; ``final``: the cell's last step, which no forward follows, so have DDP
        store them now."""
        if iteration > 10 and iteration % self.rate:
            return None  # not a sampled iteration: nothing to read (and reading costs)
        ddp = self.ddp()
        if ddp is None:  # the model is gone: its last step goes out without its comm
            return None
        try:
            logger = ddp.logger
            if final:
                logger.set_runtime_stats_and_log()
            data = logger._get_ddp_logging_data()
            d = data.ints_map  # (DDP's own accessor also copies the strings: 3x the time)
        except Exception:  # a torch without these: the step is reported without its comm
            return None
        end = d.get("backward_comm_time_end") or 0
        start = d.get("backward_comm_time_start") or 0
        if not end or not start or end == self.last_end:
            return None  # no all-reduce since the last read (the iteration did not sync)
        self.last_end = end
        rebuilt = d.get("has_rebuilt_buckets", 0)
        if rebuilt != self.rebuilt or not self.dtype:  # DDP rebuilds its buckets once
            strs = data.strs_map
            sizes = strs.get("rebuilt_bucket_sizes") if rebuilt else strs.get("bucket_sizes")
            self.rebuilt, self.buckets = rebuilt, len(str(sizes or "0").split(","))
            self.dtype = str(strs.get("dtypes", "")).split(",")[0].strip() or "float"
        compute_end = d.get("backward_compute_time_end") or start
        return DDPTimes(compute_end / 1e9, start / 1e9, end / 1e9, self.nbytes, self.buckets,
                        self.dtype)

    def pace(self, step_s: float) -> None:
        """Time one iteration in every :data:`TIMED_EVERY_S` seconds of steps of ``step_s``.

        Called right after DDP's forward stored the last timed iteration and before the
        backward that DDP may time next, so DDP and :meth:`__call__` count with the same rate.
        """
        now, it = time.time(), self.iterations
        since, then = self.paced
        self.paced = (now, it)
        if then and it > then:  # the mean step since the last call: steadier than one step
            step_s = (now - since) / (it - then)
        # A power of two: ranks whose steps differ a little may pick neighbouring rates, and
        # the iterations the coarser one times are then timed on every rank (the notebook
        # matches a step across ranks only where every rank timed it).
        want = int(TIMED_EVERY_S / step_s) if step_s > 0 else 1
        rate = 1 << min(max(want, 1).bit_length() - 1, 13)
        if rate != self.rate:
            self.rate = rate
            ddp = self.ddp()
            if ddp is not None:
                ddp._set_ddp_runtime_logging_sample_rate(rate)

    def __reduce__(self) -> tuple:
        return _detached, ()  # a copy of the model has a reducer nbdist did not time


def _forward_pre(module: Any, args: tuple, kwargs: dict) -> None:
    faults.hang()  # if %nbdist hang armed it: held before the step's all-reduce
    # Evaluation under no_grad is not a training step.
    grad = torch.is_grad_enabled()
    timer = module._nbdist_timer
    if timer is not None and grad and module.require_backward_grad_sync:
        timer.iterations += 1  # as DDP's reducer counts, telemetry on or off
    if measurements.enabled and grad:
        # model(**batch), as Hugging Face's Trainer calls it: the batch is a keyword
        measurements.on_forward((*args, *kwargs.values()), timer,
                                module.require_backward_grad_sync)


def _forward_post(_module: Any, _args: tuple, output: Any) -> None:
    if measurements.enabled:
        measurements.on_forward_end(output)


def _attach(ddp: Any) -> None:
    """Time ``ddp``'s steps and all-reduces (only models built while telemetry is on).

    Called at the end of ``DDP.__init__``. Adds the forward hooks that open steps. A CPU model
    is then timed by DDP's own timer (:class:`_DDPTimer`); a GPU model gets :func:`_timed_hook`
    in the reducer's one comm-hook place, with a fresh :class:`_HookSlot` holding DDP's
    default all-reduce. Models on the compiled Python reducer, or for which DDP already
    registered a hook itself (mixed precision), get steps only.
    """
    ddp._nbdist_timer = None
    if not measurements.enabled:
        return
    ddp.register_forward_pre_hook(_forward_pre, with_kwargs=True)
    ddp.register_forward_hook(_forward_post)
    if getattr(ddp, "_use_python_reducer", False) or ddp._comm_hooks:
        return  # compiled reducer, or DDP registered a hook itself: steps only
    if not measurements.buckets and not any(p.is_cuda for p in ddp.module.parameters()):
        ddp._set_ddp_runtime_logging_sample_rate(1)  # DDP times every iteration, in C++
        ddp._nbdist_timer = _DDPTimer(ddp)
        return
    slot = _HookSlot(default_hooks.allreduce_hook, ddp.process_group)
    _original["register_comm_hook"](ddp, slot, _timed_hook)
    ddp._nbdist_slot = slot


def _register_comm_hook(self: Any, state: object, hook: Callable) -> None:
    """``DDP.register_comm_hook``: on a hooked model, put ``hook`` in the slot.

    Does what DDP's own method does (check the hook, name it for DDP's logger, remember it in
    ``_comm_hooks``, refuse a second one) except registering with the reducer, which already
    holds :func:`_timed_hook`. A hook the session's setting put there is replaced, not
    refused: the cell's own hook wins. Models nbdist did not hook get DDP's method unchanged.
    """
    _put_hook(self, state, hook)
    tuning.report(self, hook=tuning.hook_name(hook), by_setting=False)


def _put_hook(self: Any, state: object, hook: Callable) -> None:
    slot = getattr(self, "_nbdist_slot", None)
    if slot is None and getattr(self, "_nbdist_timer", None) is not None:
        # A CPU model timed by DDP's timer: a hook of the user's is timed by _timed_hook,
        # which takes the reducer's hook place now, the user's hook in its slot.
        self._check_comm_hook(hook)
        slot = _HookSlot(hook, state)
        slot.user = True
        _original["register_comm_hook"](self, slot, _timed_hook)
        self._comm_hooks[-1] = (hook, state)  # what DDP remembers is the user's hook
        self.logger._set_comm_hook_name(getattr(hook, "__qualname__", repr(hook)))
        self._nbdist_slot, self._nbdist_timer = slot, None
        return None
    if slot is None:
        return _original["register_comm_hook"](self, state, hook)
    if slot.user and not slot.chosen:
        raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be "
                           "called once.")
    self._check_comm_hook(hook)
    self.logger._set_comm_hook_name(getattr(hook, "__qualname__", repr(hook)))
    if slot.chosen:
        self._comm_hooks[-1] = (hook, state)  # the cell's hook in the setting's place
    else:
        self._comm_hooks.append((hook, state))
    slot.hook, slot.state, slot.user, slot.chosen = hook, state, True, False
    return None


def _use_hook(ddp: Any, name: str) -> None:
    """Register the compression hook ``name`` the session's setting asks for on a model just
    built, in the slot, so that a hook the cell registers afterwards replaces it."""
    if any(h is not _timed_hook for h, _ in ddp._comm_hooks) or \
            getattr(ddp, "_use_python_reducer", False):
        return  # DDP registered one itself (mixed precision), or the compiled reducer
    if getattr(ddp, "_nbdist_slot", None) is None and getattr(ddp, "_nbdist_timer", None) is None:
        slot = _HookSlot(default_hooks.allreduce_hook, ddp.process_group)  # telemetry off
        _original["register_comm_hook"](ddp, slot, _timed_hook)
        ddp._nbdist_slot = slot
    _put_hook(ddp, *tuning.hook_for(ddp, name))
    ddp._nbdist_slot.chosen = True
    tuning.report(ddp, hook=name, by_setting=True)


def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
    """``DDP._register_builtin_comm_hook``: on a hooked model, use the C++ hook's Python twin.

    ``ALLREDUCE`` and ``FP16_COMPRESS`` become :func:`_register_comm_hook` with DDP's Python
    hook of the same arithmetic; other types, and models nbdist did not hook, go to DDP.
    """
    python_twin = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                   dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
    hooked = getattr(self, "_nbdist_slot", None) is not None or \
        getattr(self, "_nbdist_timer", None) is not None
    if not hooked or comm_hook_type not in python_twin or (
            comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE
            and getattr(self, "_nbdist_slot", None) is None):
        # DDP's timer times the C++ all-reduce hook as it times DDP's default
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
        faults.hang()  # if %nbdist hang armed it: held before it takes part
        meas = measurements
        if not meas.enabled:
            return fn(*args, **kwargs)
        rec = getattr(meas.local, "bucket", None)
        if rec is not None:  # inside a DDP hook: this is the bucket's traffic
            nbytes, dtype = payload(args, kwargs)
            rec.nbytes += nbytes
            rec.dtype, rec.op = dtype, name
            if rec.issued is None:
                rec.issued = time.time()
            return fn(*args, **kwargs)
        if not meas.collectives:
            return fn(*args, **kwargs)
        nbytes, dtype = payload(args, kwargs)
        is_async = kwargs.get("async_op", False) if async_at is None or len(args) <= async_at \
            else args[async_at]
        group = kwargs.get("group") if group_at is None or len(args) <= group_at \
            else args[group_at]
        dim = dim_of(group)  # the mesh dimension of an explicit group (FSDP2's, a 2-D mesh's)
        t0 = time.time()
        watch.enter(name, nbytes, dtype, t0)  # where the hang doctor finds it
        try:
            work = fn(*args, **kwargs)
        finally:
            watch.leave()
        if is_async and work is not None:
            try:
                work.get_future().then(lambda _f: meas.on_collective(
                    name, t0, time.time(), nbytes, dtype, blocking=False, dim=dim))
            except RuntimeError:  # some works (send/recv on gloo) have no future
                pass
        else:
            meas.on_collective(name, t0, time.time(), nbytes, dtype, blocking=True, dim=dim)
        return work

    wrapper._nbdist_original = fn  # type: ignore[attr-defined]
    return wrapper


# ----------------------------------------------------------------- optimizer steps
def _optimizer_pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    tuning.step_begins()
    # A parameter server's thread steps its optimizer beside the rank's training: not a step.
    if measurements.enabled and not getattr(measurements.local, "server", False):
        if optimizer.__dict__.get("_nbdist_seen") is not memory.optimizers:
            # Once per optimizer: a WeakSet's add makes a weak reference on every call.
            memory.optimizers.add(optimizer)
            optimizer._nbdist_seen = memory.optimizers  # type: ignore[attr-defined]
        optimizer._nbdist_cell = measurements.cells  # type: ignore[attr-defined]
        measurements.on_optimizer_step(begin=True)


def _optimizer_post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if measurements.enabled and not getattr(measurements.local, "server", False):
        measurements.on_optimizer_step(begin=False)
    tuning.step_ended()  # last: a trial's last step ends the cell here (TrialDone)


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
        choice = tuning.settle(args, kwargs)  # the session's setting, where the cell says none
        init(self, *args, **kwargs)
        _attach(self)
        tuning.report(self, choice)
        if choice.hook is not None:
            _use_hook(self, choice.hook)

    DDP.__init__ = __init__
    DDP.register_comm_hook = _register_comm_hook
    DDP._register_builtin_comm_hook = _register_builtin_comm_hook
    # Without DDP, optimizer steps are the training steps (FSDP2, ZeRO, plain optimizers).
    _handles.append(register_optimizer_step_pre_hook(_optimizer_pre))
    _handles.append(register_optimizer_step_post_hook(_optimizer_post))
    measurements.memory_probe, measurements.memory_reset = memory.probe, memory.reset_device_peak
    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None:
            _original[f"dist.{name}"] = fn
            setattr(dist, name, _wrap_collective(name, fn))


def uninstall() -> None:
    """Undo :func:`install` (models already built keep their hooks, which then pass through)."""
    while _handles:
        _handles.pop().remove()
    measurements.memory_probe = measurements.memory_reset = None
    for key, fn in _original.items():
        if key.startswith("dist."):
            setattr(dist, key[5:], fn)
        else:
            setattr(DDP, key, fn)
    _original.clear()
