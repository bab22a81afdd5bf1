"""Worker-side telemetry: steps, gradient all-reduce timing, collectives, progress and log.

Installed once per worker process (at join) and switched on or off per cell. It never sends a
message itself: it hands plain-dict events to the cell's :class:`~.capture.EventSink`, which
batches them, so a bucket or a step costs a few ``time.time()`` calls and a list append.

How each number is measured
---------------------------
* **Steps (DDP).** A forward of a ``DistributedDataParallel`` model with grad enabled starts a
  step once the previous step has synchronized gradients, so ``no_sync()`` micro-batches fold
  into the step that finally all-reduces. A step lasts until the next one starts; the last
  step of a cell ends when its gradients are synchronized (its optimizer step is not seen).
  Forward is the DDP model's forward call; backward runs from the end of forward (so it
  includes the loss) to the last bucket's all-reduce completing.
* **Buckets.** nbdist registers a communication hook on every DDP model built in a cell with
  telemetry on. It calls the hook the user registered (or DDP's default all-reduce) and times
  it from the bucket becoming ready to the hook's future completing. Bytes are what the hook
  passed to ``torch.distributed`` collectives while it ran (half the bucket for fp16
  compression); a hook that bypasses ``torch.distributed`` is charged the bucket's size and
  marked ``measured="bucket"``.
* **Exposed communication** is the wait that compute did not hide: from the last bucket being
  ready (the end of backward compute) to the last bucket's all-reduce finishing, plus the time
  spent in blocking collectives called in the step.
* **Collectives** called in a cell through ``torch.distributed`` are timed on the host, from
  the call to its return (or, with ``async_op=True``, to its future completing).

On CUDA, bucket completion comes from CUDA events recorded in the hook's future callback, read
without synchronizing when the step closes; a bucket whose events have not completed yet is
reported with bytes but no time.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional

from ..telemetry import events as ev
from ..telemetry.intervals import exposed_seconds

_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "all_to_all",
                "barrier")
# How often a progress bar reports its position (seconds); the end is always reported.
_PROGRESS_EVERY = 0.1


class _Bucket:
    """One gradient bucket's trip through the hook in one step."""

    __slots__ = ("index", "ready", "issued", "done", "nbytes", "dtype", "op", "cuda")

    def __init__(self, index: int, ready: float):
        self.index = index
        self.ready = ready
        self.issued: Optional[float] = None
        self.done: Optional[float] = None
        self.nbytes = 0
        self.dtype = ""
        self.op = ""
        self.cuda: Optional[tuple[Any, Any]] = None  # (event at ready, event at done)


class _Step:
    __slots__ = ("n", "t0", "source", "samples", "fwd0", "fwd1", "buckets",
                 "coll_total", "coll_exposed", "last")

    def __init__(self, n: int, t0: float, source: str):
        self.n = n
        self.t0 = t0
        self.source = source
        self.samples = 0
        self.fwd0: Optional[float] = None
        self.fwd1: Optional[float] = None
        self.buckets: list[_Bucket] = []
        self.coll_total = 0.0
        self.coll_exposed = 0.0
        self.last = t0  # latest activity seen, the end of a cell's last step


class Telemetry:
    """Per-process telemetry state; one instance, :data:`telemetry`."""

    def __init__(self) -> None:
        self.sink: Any = None
        self.enabled = False
        self.collectives = True
        self.step: Optional[_Step] = None
        self.steps = 0
        self.ddp_seen = False
        self.bars = 0
        self.local = threading.local()  # .bucket: the bucket whose hook is running
        self.lock = threading.Lock()

    # ------------------------------------------------------------- cell lifecycle
    def begin_cell(self, sink: Any, enabled: bool = True, collectives: bool = True) -> None:
        self.sink = sink
        self.enabled = enabled and sink is not None
        self.collectives = collectives
        self.step, self.steps, self.ddp_seen = None, 0, False

    def end_cell(self) -> None:
        """Report the cell's open step and stop recording."""
        if self.step is not None:
            self._close(self.step.last, final=True)
        self.enabled = False
        self.sink = None

    def emit(self, event: dict[str, Any]) -> None:
        sink = self.sink
        if sink is not None:
            sink.emit(event)

    # ------------------------------------------------------------- steps
    def _open(self, t0: float, source: str) -> _Step:
        self.step = _Step(self.steps, t0, source)
        self.steps += 1
        return self.step

    def _close(self, t1: float, final: bool = False) -> None:
        st, self.step = self.step, None
        if st is None:
            return
        ready_last, comm_end, total, nbytes = None, None, st.coll_total, 0
        spans = []
        for b in st.buckets:
            _resolve_cuda(b)
            ready_last = b.ready if ready_last is None else max(ready_last, b.ready)
            nbytes += b.nbytes
            if b.done is not None:
                comm_end = b.done if comm_end is None else max(comm_end, b.done)
                total += b.done - (b.issued or b.ready)
                spans.append((b.issued or b.ready, b.done))
                self.emit(ev.comm(b.op or "all_reduce", b.issued or b.ready, b.done, b.nbytes,
                                  step=st.n, bucket=b.index, dtype=b.dtype,
                                  measured="wire" if b.op else "bucket"))
            else:
                self.emit(ev.comm(b.op or "all_reduce", b.ready, b.ready, b.nbytes, step=st.n,
                                  bucket=b.index, dtype=b.dtype, measured="untimed"))
        exposed = st.coll_exposed
        if ready_last is not None and spans:
            exposed += exposed_seconds(ready_last, spans)
        bwd = None
        if ready_last is not None:
            start = st.fwd1 or st.t0
            bwd = (start, max(x for x in (comm_end, ready_last, start) if x is not None))
        if final:
            t1 = max(x for x in (t1, comm_end, st.fwd1, st.t0) if x is not None)
        self.emit(ev.step(st.n, st.t0, t1, samples=st.samples, comm_total_s=total,
                          comm_exposed_s=exposed, comm_bytes=nbytes, buckets=len(st.buckets),
                          fwd=(st.fwd0, st.fwd1) if st.fwd0 and st.fwd1 else None, bwd=bwd,
                          source=st.source))

    # called from DDP module hooks (main thread)
    def on_forward(self, args: tuple) -> None:
        if _grad_enabled is not None and not _grad_enabled():
            return  # evaluation under no_grad is not a training step
        now = time.time()
        st = self.step
        if st is not None and st.source == "progress":
            st = self.step = None  # DDP found: it owns the steps from here on
            self.steps -= 1
        if st is None or st.buckets:
            if st is not None:
                self._close(now)
            st = self._open(now, "ddp")
        self.ddp_seen = True
        st.samples += _batch_size(args)
        if st.fwd0 is None:
            st.fwd0 = now

    def on_forward_end(self, output: Any) -> None:
        st = self.step
        if st is None:
            return
        # The backward span starts here: a hook on the output would pin it to the first
        # gradient, but a Python hook inside autograd costs more than it tells.
        st.fwd1 = st.last = time.time()

    # called from nbdist.progress (main thread)
    def on_iteration(self, item: Any, t0: float) -> None:
        if self.ddp_seen:
            return
        if self.step is not None:
            self._close(t0)
        self._open(t0, "progress").samples = _batch_size((item,)) or 1

    # called from the comm hook and collective wrappers (any thread)
    def on_collective(self, name: str, t0: float, t1: float, nbytes: int, dtype: str,
                      blocking: bool) -> None:
        with self.lock:
            st = self.step
            if st is not None:
                st.coll_total += t1 - t0
                if blocking:
                    st.coll_exposed += t1 - t0
                st.last = max(st.last, t1)
        self.emit(ev.comm(name, t0, t1, nbytes, step=st.n if st is not None else None,
                          dtype=dtype))


telemetry = Telemetry()


# ----------------------------------------------------------------- helpers
def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _tensor_type() -> type:
    import torch  # cached in sys.modules after the first call; torch is loaded by then anyway

    return torch.Tensor


def _batch_size(args: Iterable[Any]) -> int:
    """The leading dimension of the first tensor found in ``args`` (0 when there is none)."""
    tensor = _tensor_type()
    for a in args:
        if isinstance(a, tensor):
            return int(a.shape[0]) if a.dim() else 1
        if isinstance(a, (list, tuple)) and a and not hasattr(a, "_fields"):
            n = _batch_size(a[:1])
            if n:
                return n
        if isinstance(a, dict) and a:
            n = _batch_size(list(a.values())[:1])
            if n:
                return n
    return 0


def _payload(args: tuple, kwargs: dict) -> tuple[int, str]:
    """Bytes and dtype handed to a collective: its first tensor, else its first tensor list."""
    import torch

    values = list(args) + list(kwargs.values())
    for v in values:
        if isinstance(v, torch.Tensor):
            return _nbytes(v), str(v.dtype).replace("torch.", "")
    for v in values:
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            return sum(_nbytes(t) for t in v), str(v[0].dtype).replace("torch.", "")
    return 0, ""


def _resolve_cuda(b: _Bucket) -> None:
    if b.cuda is None or b.done is not None:
        return
    start, stop = b.cuda
    if stop is not None and start.query() and stop.query():  # never synchronizes
        b.done = b.ready + start.elapsed_time(stop) / 1000.0


# ----------------------------------------------------------------- DDP hook composition
class _HookSlot:
    """The hook nbdist registers with DDP's reducer calls whatever hook is in this slot."""

    __slots__ = ("hook", "state", "user")

    def __init__(self, hook: Callable, state: Any):
        self.hook = hook
        self.state = state
        self.user = False


def _timed_hook(slot, bucket):  # type: ignore[no-untyped-def]
    # Unannotated on purpose: DDP rejects hooks whose annotations are not GradBucket/Future.
    tel = telemetry
    if not tel.enabled:
        return slot.hook(slot.state, bucket)
    buf = bucket.buffer()
    rec = _Bucket(bucket.index(), time.time())
    if buf.is_cuda:
        import torch

        rec.cuda = (torch.cuda.Event(enable_timing=True), None)
        rec.cuda[0].record()
    st = tel.step
    if st is None:
        st = tel._open(rec.ready, "ddp")
    st.buckets.append(rec)
    if not slot.user:
        # DDP's default, inlined: one future callback per bucket instead of two.
        group = slot.state if slot.state is not None else _dist_world()
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
    if not rec.op:  # the hook used no torch.distributed call we could see
        rec.nbytes, rec.dtype = _nbytes(buf), _dtype_name(buf)

    def done(f: Any) -> Any:
        _mark_done(rec)
        return f.value()

    return fut.then(done)


def _mark_done(rec: _Bucket) -> None:
    if rec.cuda is not None:
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()  # on the stream the result is consumed on: completes with the work
        rec.cuda = (rec.cuda[0], end)
    else:
        rec.done = time.time()


def _dist_world() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD


def _dtype_name(t: Any) -> str:
    return str(t.dtype)[6:]  # "torch.float16" -> "float16"


def _attach(ddp: Any) -> None:
    """Time ``ddp``'s steps and buckets (only models built while telemetry is on)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if not telemetry.enabled:
        return
    ddp.register_forward_pre_hook(lambda _m, args: telemetry.on_forward(args)
                                  if telemetry.enabled else None)
    ddp.register_forward_hook(lambda _m, _a, out: telemetry.on_forward_end(out)
                              if telemetry.enabled else None)
    if getattr(ddp, "_use_python_reducer", False) or ddp._comm_hooks:
        return  # compiled reducer, or DDP registered a hook itself: steps only
    slot = _HookSlot(default_hooks.allreduce_hook, ddp.process_group)
    _original["register_comm_hook"](ddp, slot, _timed_hook)
    ddp._nbdist_slot = slot


def _register_comm_hook(self: Any, state: object, hook: Callable) -> None:
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
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    python_twin = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                   dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
    if getattr(self, "_nbdist_slot", None) is None or comm_hook_type not in python_twin:
        return _original["_register_builtin_comm_hook"](self, comm_hook_type)
    # The C++ hook cannot be wrapped; its Python twin does the same arithmetic and is timed.
    return _register_comm_hook(self, self.process_group, python_twin[comm_hook_type])


# ----------------------------------------------------------------- collectives
def _wrap_collective(name: str, fn: Callable) -> Callable:
    params = list(inspect.signature(fn).parameters)
    async_at = params.index("async_op") if "async_op" in params else None

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
        t0 = time.time()
        work = fn(*args, **kwargs)
        if is_async and work is not None:
            try:
                work.get_future().then(lambda _f: tel.on_collective(
                    name, t0, time.time(), nbytes, dtype, blocking=False))
            except RuntimeError:  # some works (send/recv on gloo) have no future
                pass
        else:
            tel.on_collective(name, t0, time.time(), nbytes, dtype, blocking=True)
        return work

    wrapper._nbdist_original = fn  # type: ignore[attr-defined]
    return wrapper


_original: dict[str, Callable] = {}
_grad_enabled: Optional[Callable[[], bool]] = None


def install() -> None:
    """Patch DDP and ``torch.distributed``'s collectives in this process (idempotent)."""
    global _grad_enabled
    if _original:
        return
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    _grad_enabled = torch.is_grad_enabled

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
    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None:
            _original[f"dist.{name}"] = fn
            setattr(dist, name, _wrap_collective(name, fn))


def uninstall() -> None:
    """Undo :func:`install` (models already built keep their hooks, which then pass through)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    for key, fn in _original.items():
        if key.startswith("dist."):
            setattr(dist, key[5:], fn)
        else:
            setattr(DDP, key, fn)
    _original.clear()


# ----------------------------------------------------------------- user API
class progress:
    """Iterate with a progress bar merged across ranks in the notebook (like ``tqdm``).

    Parameters
    ----------
    iterable : iterable, optional
        What to iterate over. Without it, call :meth:`update` by hand.
    total : int, optional
        Number of items; taken from ``len(iterable)`` when it has one.
    desc : str
        Label shown next to the bar.

    Outside a ``%%distributed`` cell it is a plain iterator. Without a DDP model in the cell,
    each iteration counts as a training step (time per step, samples/s from the batch size).

    Examples
    --------
    >>> for x, y in nbdist.progress(loader, desc="epoch 1"):   # doctest: +SKIP
    ...     loss = train_step(x, y)
    """

    def __init__(self, iterable: Optional[Iterable[Any]] = None, total: Optional[int] = None,
                 desc: str = ""):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total = total
        self.desc = desc
        self.n = 0
        telemetry.bars += 1
        self.bar = telemetry.bars
        self._sent = 0.0
        self._report(time.time())

    def _report(self, now: float, done: bool = False) -> None:
        if telemetry.enabled:
            self._sent = now
            telemetry.emit(ev.progress(self.bar, self.desc, self.n, self.total, now, done))

    def update(self, n: int = 1) -> None:
        """Advance the bar by ``n`` items."""
        self.n += n
        now = time.time()
        if now - self._sent >= _PROGRESS_EVERY or (self.total is not None
                                                    and self.n >= self.total):
            self._report(now)

    def close(self) -> None:
        self._report(time.time(), done=True)

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("progress() without an iterable: call update() instead")
        it = iter(self.iterable)
        try:
            while True:
                t0 = time.time()
                try:
                    item = next(it)
                except StopIteration:
                    if telemetry.enabled and not telemetry.ddp_seen and telemetry.step:
                        telemetry._close(t0)
                    return
                if telemetry.enabled:
                    telemetry.on_iteration(item, t0)
                yield item
                self.update()
        finally:
            self.close()

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this progress bar has no total")
        return self.total

    def __enter__(self) -> progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def log(step: Optional[int] = None, **values: Any) -> None:
    """Show the latest values (``loss=...``, ``acc=...``) in the notebook's dashboard.

    Tensors are turned into numbers with ``.item()``, which waits for the GPU: log every few
    steps rather than every step when that matters.
    """
    if not telemetry.enabled:
        return
    out: dict[str, float] = {}
    for k, v in values.items():
        if hasattr(v, "item"):
            v = v.item()
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError):
            continue  # non-numeric values have no place in a chart
    if step is None and telemetry.step is not None:
        step = telemetry.step.n
    telemetry.emit(ev.scalars(out, time.time(), step))
