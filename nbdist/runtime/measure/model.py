"""Worker-side measurement model: steps, gradient buckets and collectives become events.

One :class:`Measurements` per process, :data:`measurements`, switched on or off per cell. The DDP
hooks and collective wrappers (:mod:`.ddp_hooks`) and the user API (:mod:`.progress`) report to
it. It never sends a message itself: it hands plain-dict events to the cell's
:class:`~.capture.EventSink`, which batches them, so a bucket or a step costs a few
``time.time()`` calls and a list append.

The notebook imports this module too (``nbdist.progress`` → :mod:`.progress` → here), and
``import nbdist`` must not load torch, so nothing here imports torch: what needs it looks it up
in ``sys.modules``, where a worker that has tensors already has it.

How each number is measured
---------------------------
* **Steps (DDP).** A forward of a ``DistributedDataParallel`` model with grad enabled starts a
  step once the previous step has synchronized gradients, so ``no_sync()`` micro-batches fold
  into the step that finally all-reduces. A step lasts until the next one starts; the last
  step of a cell ends when its gradients are synchronized (its optimizer step is not seen).
  Forward is the DDP model's forward call; backward runs from the end of forward (so it
  includes the loss) to the last bucket's all-reduce completing.
* **The gradient all-reduce (CPU, default).** DDP's own reducer times the iteration in C++
  (:class:`DDPTimes`): when the last bucket was ready, when the first bucket's all-reduce was
  launched and when the reducer had waited for the last. It stores the times at the next
  forward, so a step is emitted at the end of the next step's forward (the cell's last when
  the cell ends). One all-reduce span per step, its bytes the buckets' sizes.
* **Buckets** (GPU models, ``bucket_timing``, or a hook of the user's). nbdist registers a
  communication hook on the DDP model. It calls the hook the user registered (or DDP's default
  all-reduce) and times it from the bucket becoming ready to the hook's future completing.
  Bytes are what the hook passed to ``torch.distributed`` collectives while it ran (half the
  bucket for fp16 compression); a hook that bypasses ``torch.distributed`` is charged the
  bucket's size and marked ``measured="bucket"``.
* **Exposed communication** is the wait that compute did not hide: from the last bucket being
  ready (the end of backward compute) to the last bucket's all-reduce finishing, plus the time
  spent in blocking collectives called in the step.
* **Steps without DDP** (FSDP2, ZeRO, or any optimizer) are optimizer steps: a step ends when
  the outermost ``optimizer.step()`` returns (ZeRO's inner optimizer does not count twice) and
  starts at the first collective after the previous one. Collectives seen before a cell's first
  optimizer step are held back and attributed to that step; in a cell that never steps an
  optimizer they stay unattributed, as before.
* **Collectives** called in a cell through ``torch.distributed`` are timed on the host, from
  the call to its return (or, with ``async_op=True``, to its future completing). Their bytes are
  the largest buffer handed to them: the whole tensor for an all-reduce, the gathered output of
  an all-gather, the input of a reduce-scatter (as nccl-tests counts them).
* **Steps of a parameter server** end when a worker pushes its gradients
  (:mod:`.parameter_server`); pull and push are timed as blocking communication.
* **Samples** come from the model where nbdist sees it: the batch of a DDP forward, of a
  parameter-server worker's model, of the first pipeline stage's ``schedule.step(x)`` (later
  stages count none: the same samples), and of a tensor-parallel module divided by the size
  of its mesh (its ranks share one batch). Otherwise each ``nbdist.progress`` item counts.
* **Pipelines** (:mod:`.parallel_hooks`): each stage's forward and backward of every
  microbatch is timed, and so is every send and receive from its call to the end of its
  ``wait()``. A schedule's ``step()`` reports its span, the time its stages computed and the
  time they waited on transfers; what is not compute is the bubble.
* **Memory** is sampled after a step at most twice a second, and at the end of a cell: bytes of
  the parameters, gradients and state of every optimizer stepped in this process (a sharded
  tensor counts its local shard; a tensor shared by two optimizers counts once), the process's
  resident memory and its peak, and on a GPU the cell's ``torch.cuda.max_memory_allocated``.

On CUDA, bucket completion comes from CUDA events recorded in the hook's future callback, read
without synchronizing when the step closes; a bucket whose events have not completed yet is
reported with bytes but no time.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Optional

from ...telemetry import events as ev
from .. import libraries
from .spec import DEFAULT, Measure
from .stall_probe import watch
from .steps import DDPTimer, DDPTimes, Step, step_events
from .tensors import batch_size

# Collectives held for an optimizer step to claim; past this many, the cell is not training.
_MAX_HELD = 512
# ... once an optimizer has stepped in the cell (FSDP2 on a deep model issues many per step).
_MAX_HELD_TRAINING = 50_000


class Measurements:
    """Per-process telemetry state; one instance, :data:`measurements`."""

    def __init__(self) -> None:
        self.sink: Any = None
        self.enabled = False
        self.collectives = True
        self.buckets = False  # DDP models built now time each bucket (a Python comm hook)
        self.step: Optional[Step] = None
        self.closing: Optional[Step] = None  # ended, waiting for DDP to store its times
        self.steps = 0
        self.ddp_seen = False
        self.bars = 0
        self.cells = 0  # cells begun in this process
        self.local = threading.local()  # .bucket: the bucket whose hook is running
        self.lock = threading.Lock()
        self.optim_depth = 0  # optimizer.step() calls in progress (ZeRO nests two)
        self.optim_seen = False  # an optimizer stepped in this cell: it defines the steps
        self.holding = True
        self.pending_samples: float = 0  # samples counted towards the next optimizer step
        self.model_samples = False  # a model nbdist sees counts samples (not progress items)
        self.pipe_busy = 0.0  # pipeline stages' compute time in the running schedule step
        self.pipe_wait = 0.0  # ... and their time blocked on sends and receives
        #: returns the bytes this rank holds; starts the GPU's peak afresh (installed on
        #: workers, where torch is)
        self.memory_probe: Optional[Callable[[], Optional[dict[str, Any]]]] = None
        self.memory_reset: Optional[Callable[[], None]] = None
        self._memory_at = 0.0

    # ------------------------------------------------------------- cell lifecycle
    def begin_cell(self, sink: Any, measure: Measure = DEFAULT) -> None:
        """Start recording a cell's events into ``sink``, as ``measure`` says (with
        ``measure.telemetry`` off, record nothing)."""
        self.sink = sink
        self.cells += 1
        self.enabled = measure.telemetry and sink is not None
        self.collectives = measure.collectives
        self.buckets = measure.buckets
        self.step, self.steps, self.ddp_seen = None, 0, False
        self.closing = None
        self.optim_depth, self.optim_seen, self.pending_samples = 0, False, 0
        self.model_samples = False
        self.pipe_busy = self.pipe_wait = 0.0
        self.holding = True  # collectives may open a step for an optimizer to confirm
        self._memory_at = 0.0
        if self.enabled and self.memory_reset is not None:
            self.memory_reset()  # the GPU's peak is this cell's
        if self.enabled:  # what training libraries log is reported too (their extension points)
            libraries.begin_cell()

    def end_cell(self) -> None:
        """Report the cell's open step and memory, and stop recording."""
        self._close_timed()
        st = self.step
        if st is not None:  # a step opened by collectives alone is dropped (see close_step)
            self.close_step(st.last, final=True)
        if self.enabled and (self.optim_seen or self.ddp_seen):
            self.sample_memory(time.time(), force=True)
        libraries.end_cell()
        self.enabled = False
        self.sink = None

    def emit(self, event: dict[str, Any]) -> None:
        """Hand ``event`` to the cell's sink, if a cell is running."""
        sink = self.sink
        if sink is not None:
            sink.emit(event)
            if event["kind"] in ev.PROGRESS_KINDS:  # the hang doctor's clock restarts
                watch.progress()

    # ------------------------------------------------------------- steps
    def open_step(self, t0: float, source: str) -> Step:
        """Open the next step at ``t0``; ``source`` is ``"ddp"``, ``"optim"`` or
        ``"progress"``."""
        self.step = Step(self.steps, t0, source)
        self.steps += 1
        return self.step

    def close_step(self, t1: float, final: bool = False) -> None:
        """Emit the open step (ending at ``t1``) and its buckets; ``final``: the cell's last."""
        st, self.step = self.step, None
        if st is None:
            return
        if st.held is not None and (final or not self.optim_seen):
            # No optimizer step closed it (none ever stepped, or these collectives came after
            # the cell's last one): they were not part of a training step.
            self.step = st
            self._drop_provisional()
            return
        self._emit_step(st, t1, final,
                        st.timer(final, st.iteration) if st.timer is not None else None)

    def _close_timed(self, pace: bool = False) -> None:
        """Emit the step that ended at the last DDP forward, now that DDP stored its times;
        ``pace``: DDP's forward has run, so its timer may be told which iterations to time."""
        st, self.closing = self.closing, None
        if st is not None:
            self._emit_step(st, st.t1 or st.last, False, st.timer(False, st.iteration), pace)

    def _emit_step(self, st: Step, t1: float, final: bool, ddp: Optional[DDPTimes],
                   pace: bool = False) -> None:
        for e in st.held or ():
            e["step"] = st.n
            self.emit(e)
        if ddp is not None and ddp.comm_end < st.t0:
            ddp = None  # older times: DDP did not time this step's iteration
        if ddp is not None and pace:
            # Before the backward DDP may time next, so DDP and the timer count alike.
            st.timer.pace(t1 - st.t0)  # type: ignore[union-attr]
        sink = self.sink
        if sink is None:
            return
        watch.progress()
        defer = getattr(sink, "defer", None)
        if defer is not None and not st.buckets:
            # The step's events are built when its batch is sent, on the sending thread, a
            # batch of steps at a time: the training thread only hands the step over. (GPU
            # buckets are read here: their CUDA events belong to this thread's device.)
            defer(step_events, st, t1, final, ddp)
            return
        for e in step_events(st, t1, final, ddp):
            sink.emit(e)

    def _drop_provisional(self) -> None:
        """Give up the open step no optimizer confirmed: its collectives go out unattributed."""
        st, self.step = self.step, None
        self.steps -= 1
        for e in st.held or ():
            e["step"] = None
            self.emit(e)

    # called from DDP module hooks (main thread), for forwards with grad enabled only
    def on_forward(self, args: tuple, timer: Optional[DDPTimer] = None,
                   syncs: bool = True) -> None:
        """A DDP forward starts: open a step unless ``no_sync()`` micro-batches fold into it.

        ``timer`` reads the model's steps from DDP's own timer (see :class:`DDPTimes`);
        ``syncs``: this forward's backward all-reduces (not under ``no_sync()``).
        """
        now = time.time()
        with self.lock:
            st = self.step
            if st is not None and st.held is not None and not self.optim_seen:
                self._drop_provisional()  # DDP owns the steps: earlier collectives were not one
                st = None
        if st is not None and st.source == "progress":
            st = self.step = None  # DDP found: it owns the steps from here on
            self.steps -= 1
        if st is None or st.buckets or st.timer is not None:
            if st is not None:
                if st.timer is not None:
                    # DDP stores the step's times in this forward: emit it once that is done
                    self._close_timed()
                    self.step, st.t1, self.closing = None, now, st
                else:
                    self.close_step(now)
            st = self.open_step(now, "ddp")
        self.ddp_seen = True
        if timer is not None and syncs:
            st.timer, st.iteration = timer, timer.iterations
        st.samples += batch_size(args)
        if st.fwd0 is None:
            st.fwd0 = now

    def on_forward_end(self, output: Any) -> None:
        """A DDP forward returned: backward starts here."""
        now = time.time()
        if self.closing is not None:
            self._close_timed(pace=True)
        st = self.step
        if st is None:
            return
        # The backward span starts here: a hook on the output would pin it to the first
        # gradient, but a Python hook inside autograd costs more than it tells.
        st.fwd1 = st.last = now

    # called from global optimizer step hooks (main thread)
    def on_optimizer_step(self, begin: bool) -> None:
        """``optimizer.step()`` begins or returns; the outermost return ends a step."""
        if begin:
            self.optim_depth += 1
            return
        self.optim_depth = max(0, self.optim_depth - 1)
        if self.optim_depth:
            return  # an inner optimizer (ZeRO's): the outer one ends the step
        if self.ddp_seen:
            self.sample_memory(time.time())  # DDP owns the steps; the memory is sampled here
            return
        self.end_step("optim")

    def end_step(self, source: str) -> None:
        """A training step without DDP ends now: an optimizer step returned (``"optim"``) or a
        parameter-server worker pushed its gradients (``"ps"``)."""
        now = time.time()
        self.optim_seen = self.holding = True
        with self.lock:
            st = self.step
            if st is not None and st.source == "progress":
                self.steps -= 1  # optimizer or pushes own the steps from here on
                self.step = None
                st = self.open_step(st.t0, source)
            elif st is None:
                st = self.open_step(now, source)
            else:
                st.source = source
            st.samples += self.pending_samples
            self.pending_samples = 0
            self.close_step(now)
        self.sample_memory(now)

    def count_samples(self, n: float) -> None:
        """A model nbdist sees (a parameter-server worker's, a tensor-parallel module, the
        first pipeline stage) took ``n`` samples; from now on progress items do not count."""
        if not self.model_samples:
            self.model_samples = True
            self.pending_samples = 0  # progress items so far were these same samples
            st = self.step
            if st is not None and st.source == "progress":
                st.samples = 0
        self.pending_samples += n

    # called from the pipeline schedule and stage wrappers (main thread)
    def on_stage(self, op: str, mb: int, stage: int, t0: float, t1: float) -> None:
        """A pipeline stage ran ``op`` on microbatch ``mb`` from ``t0`` to ``t1``."""
        self.pipe_busy += t1 - t0
        self.emit(ev.stage(op, mb, stage, t0, t1))

    def begin_pipeline_step(self) -> None:
        """A schedule's ``step()`` starts: its stages' compute and waits count from here."""
        self.pipe_busy = self.pipe_wait = 0.0

    def on_pipeline_step(self, t0: float, t1: float, **info: Any) -> None:
        """A schedule's ``step()`` returned; ``info`` describes it (see ``events.pipeline``)."""
        busy, wait = self.pipe_busy, self.pipe_wait
        self.pipe_busy = self.pipe_wait = 0.0
        self.emit(ev.pipeline(t0, t1, busy_s=busy, p2p_wait_s=wait, **info))
        with self.lock:
            if self.step is not None:
                self.step.last = max(self.step.last, t1)

    def sample_memory(self, now: float, force: bool = False) -> None:
        """Report the bytes this rank holds, at most every half second unless ``force``."""
        probe = self.memory_probe
        if probe is None or (not force and now - self._memory_at < 0.5):
            return
        self._memory_at = now
        try:
            held = probe()
        except Exception as exc:  # a probe bug must not fail the user's training
            sys.__stderr__.write(f"nbdist: memory probe failed: {exc!r}\n")
            self.memory_probe = None
            return
        if held is not None:
            self.emit(ev.memory(now, step=self.steps - 1 if self.steps else None, **held))

    # called from nbdist.progress (main thread)
    def on_iteration(self, item: Any, t0: float) -> None:
        """A progress bar fetched ``item`` at ``t0``: a step, unless a DDP model or an
        optimizer owns steps (then the item's batch size counts towards that step)."""
        if self.ddp_seen:
            return
        if self.optim_seen or self.model_samples:
            if not self.model_samples:
                self.pending_samples += batch_size((item,)) or 1
            return
        if self.step is not None:
            self.close_step(t0)
        self.open_step(t0, "progress").samples = batch_size((item,)) or 1

    # called from the comm hook and collective wrappers (any thread)
    def on_collective(self, name: str, t0: float, t1: float, nbytes: int, dtype: str,
                      blocking: bool, exposed_s: float = 0.0, **where: Any) -> None:
        """Count a collective outside a DDP hook; ``blocking``: compute waited for all of it,
        else ``exposed_s`` of it (the time spent in its ``wait()``). ``where`` adds the mesh
        dimension, peer and microbatch (see ``events.comm``).

        Without DDP, a collective with no step open opens one that the next optimizer step
        closes (FSDP's all-gathers start a step in its forward).
        """
        exposed = t1 - t0 if blocking else exposed_s
        watch.progress()  # even when its event waits for an optimizer step to claim it
        if where.get("peer") is not None:
            self.pipe_wait += exposed
        with self.lock:
            st = self.step
            if st is None and not self.ddp_seen and self.enabled and self.holding:
                st = self.open_step(t0, "optim")
                st.held = []
            event = ev.comm(name, t0, t1, nbytes, step=st.n if st is not None else None,
                            dtype=dtype, **where)
            if st is not None:
                st.coll_total += t1 - t0
                st.coll_exposed += exposed
                st.last = max(st.last, t1)
                if st.held is not None:  # sent when an optimizer step claims the step
                    st.held.append(event)
                    if len(st.held) >= (_MAX_HELD_TRAINING if self.optim_seen else _MAX_HELD):
                        self._drop_provisional()  # a collectives loop, not training
                        self.holding = False
                    return
        self.emit(event)


measurements = Measurements()
