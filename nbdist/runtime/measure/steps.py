"""A training step as the measurement model records it, and the events it becomes.

:class:`~.model.Measurements` opens and closes :class:`Step` records on the training thread; a
closed step becomes its events (:func:`step_events`) on the sink's sending thread, when the
batch it belongs to goes out (or at once with a sink that cannot defer). Torch-free, like
:mod:`.model`: CUDA events are used through the objects the hooks recorded.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol

from ...telemetry import events as ev
from ...telemetry.intervals import exposed_seconds
from .stall_probe import watch


class Bucket:
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


class DDPTimes(NamedTuple):
    """One step's backward as DDP's reducer timed it itself (seconds, ``time.time()``'s clock)."""

    compute_end: float  # the last gradient bucket was ready
    comm_start: float  # the first bucket's all-reduce was launched
    comm_end: float  # the reducer had waited for the last one
    nbytes: int  # bytes all-reduced (the buckets' sizes)
    buckets: int
    dtype: str


class DDPTimer(Protocol):
    """What the step accounting needs of a DDP model's own timer (``ddp_hooks._DDPTimer``)."""

    iterations: int  # syncing forwards so far: DDP's own iteration count
    nbytes: int  # bytes each syncing iteration all-reduces
    buckets: int  # gradient buckets, once known

    def __call__(self, final: bool, iteration: int) -> Optional[DDPTimes]:
        """The times DDP stored for ``iteration``, or None where it timed none."""

    def pace(self, step_s: float) -> None:
        """Steps take ``step_s``: choose which iterations DDP times from now on."""


class Step:
    """One open training step: its forward span, buckets and collective time so far."""

    __slots__ = ("n", "t0", "source", "samples", "fwd0", "fwd1", "buckets",
                 "coll_total", "coll_exposed", "last", "held", "timer", "iteration", "t1")

    def __init__(self, n: int, t0: float, source: str):
        self.n = n
        self.t0 = t0
        self.source = source
        self.samples = 0
        self.fwd0: Optional[float] = None
        self.fwd1: Optional[float] = None
        self.buckets: list[Bucket] = []
        self.coll_total = 0.0
        self.coll_exposed = 0.0
        self.last = t0  # latest activity seen, the end of a cell's last step
        # Comm events of a step no optimizer has confirmed yet: emitted when it closes.
        self.held: Optional[list[dict[str, Any]]] = None
        # Reads this step's all-reduce from DDP's own timer once DDP has stored it (a CPU
        # model on DDP's default all-reduce; see ddp_hooks); set when the step syncs.
        self.timer: Optional[DDPTimer] = None
        self.iteration = 0  # DDP's count of the iteration that synced in this step
        self.t1: Optional[float] = None  # when it ended, while it waits for its timer


# ----------------------------------------------------------------- events of a step
def step_events(st: Step, t1: float, final: bool,
                ddp: Optional[DDPTimes]) -> list[dict[str, Any]]:
    """A closed step's events: its all-reduce (DDP's timer's span, or each bucket's) and the
    step itself, ending at ``t1`` (``final``: the cell's last, which ends with its comm)."""
    out = []
    ready_last, comm_end, total, nbytes = None, None, st.coll_total, 0
    spans = []
    timed = True
    if ddp is None and st.timer is not None:
        # It synced, untimed (DDP times a sample of short steps; see ddp_hooks): its bytes
        # are known, its all-reduce's span is not.
        timed, nbytes = False, st.timer.nbytes
    if ddp is not None:
        ready_last, comm_end = ddp.compute_end, ddp.comm_end
        total += ddp.comm_end - ddp.comm_start
        nbytes = ddp.nbytes
        spans.append((ddp.comm_start, ddp.comm_end))
        out.append(ev.comm("all_reduce", ddp.comm_start, ddp.comm_end, ddp.nbytes,
                           step=st.n, dtype=ddp.dtype, measured="ddp"))
    for b in st.buckets:
        resolve_cuda(b)
        ready_last = b.ready if ready_last is None else max(ready_last, b.ready)
        if b.op == "local":
            continue  # the hook sent nothing for this bucket
        nbytes += b.nbytes
        if b.done is not None:
            comm_end = b.done if comm_end is None else max(comm_end, b.done)
            total += b.done - (b.issued or b.ready)
            spans.append((b.issued or b.ready, b.done))
            out.append(ev.comm(b.op or "all_reduce", b.issued or b.ready, b.done, b.nbytes,
                               step=st.n, bucket=b.index, dtype=b.dtype,
                               measured="wire" if b.op else "bucket"))
        else:
            out.append(ev.comm(b.op or "all_reduce", b.ready, b.ready, b.nbytes, step=st.n,
                               bucket=b.index, dtype=b.dtype, measured="untimed"))
    exposed = st.coll_exposed
    if ready_last is not None and len(spans) == 1:  # DDP's timer: one span, no union
        exposed += max(0.0, spans[0][1] - max(spans[0][0], ready_last))
    elif ready_last is not None and spans:
        exposed += exposed_seconds(ready_last, spans)
    bwd = None
    if ready_last is not None:
        start = st.fwd1 or st.t0
        bwd = (start, max(x for x in (comm_end, ready_last, start) if x is not None))
    if final:
        t1 = max(x for x in (t1, comm_end, st.fwd1, st.t0) if x is not None)
    watch.step(t1 - st.t0)
    if ddp is not None:
        nbuckets = ddp.buckets
    elif not timed:
        nbuckets = st.timer.buckets  # type: ignore[union-attr]
    else:
        nbuckets = len(st.buckets)
    out.append(ev.step(st.n, st.t0, t1, samples=st.samples, comm_total_s=total,
                       comm_exposed_s=exposed, comm_bytes=nbytes, buckets=nbuckets,
                       fwd=(st.fwd0, st.fwd1) if st.fwd0 and st.fwd1 else None, bwd=bwd,
                       source=st.source, comm_timed=timed))
    return out


def resolve_cuda(b: Bucket) -> None:
    """Fill in ``b.done`` from its CUDA events once both have completed."""
    if b.cuda is None or b.done is not None:
        return
    start, stop = b.cuda
    if stop is not None and start.query() and stop.query():  # never synchronizes
        b.done = b.ready + start.elapsed_time(stop) / 1000.0
