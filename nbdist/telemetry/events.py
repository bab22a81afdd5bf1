"""Event records that flow from workers to the notebook, as plain dicts.

Workers batch events; a batch is ``{"rank": int, "seq": int, "events": [event, ...]}``, and
``seq`` counts batches per rank so the notebook can tell when it has seen everything a cell sent.

In a batch, each run of consecutive high-rate events (:data:`TABLED`: steps, buckets and
collectives, memory samples, pipeline stages) travels as one ``table`` event: columns of
fields instead of one dict per event (:mod:`.columns` packs and unpacks them); every other
kind travels as it is. From a cell's rank (not a job watched from outside, whose wire is not
Python's) the events only the run's fold reads (:data:`SEALABLE`: the table, logged values,
bars) travel further as one ``sealed`` event, their list pickled once: the notebook's client
then rebuilds one bytes object instead of every dict and list of them, and the fold unpickles
them one batch at a time, just before it reads them (:func:`~.columns.seal`).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Optional

STREAM = "stream"  # {"kind", "name": "stdout"|"stderr", "text"}
WARNING = "warning"  # a Python warning a rank showed: {"category", "message", "filename", "lineno"}
# A rich output a rank's code displayed (IPython's display(), a matplotlib figure shown):
# {"data": a MIME bundle, "metadata", "display_id" or None, "update": replaces that display}
DISPLAY = "display"
# Telemetry. Times are the worker's ``time.time()`` seconds; durations are seconds.
STEP = "step"  # one training step on one rank; see step()
COMM = "comm"  # one timed collective (a DDP gradient bucket, or a call in the cell)
PROGRESS = "progress"  # an nbdist.progress bar's position
SCALARS = "scalars"  # values given to nbdist.log()
MEMORY = "memory"  # bytes this rank holds for training; see memory()
STAGE = "stage"  # a pipeline stage's forward or backward of one microbatch; see stage()
PIPELINE = "pipeline"  # one step of a pipeline schedule on one rank; see pipeline()
END = "end"  # the cell finished on this rank: {"ok", "error", "t"}
# Elastic training on this rank: {"what": an ElasticWhat's value, "t", "run", "epoch", ...}
ELASTIC = "elastic"
STACK = "stack"  # where a rank's cell was when it stopped making progress; see stack()
# The debugger on a rank (pdb, or input() in a cell): it stopped, left, or skipped a
# breakpoint; see debugger(). The hang doctor reads these; the notebook's console prints skips.
DEBUGGER = "debugger"
INPUT = "input"  # a rank waits for a line typed in the notebook; see input_request()
TABLE = "table"  # consecutive high-rate events of one rank, as columns; see columns.table()
DDP = "ddp"  # a DDP model the cell built, and the communication setting it runs with
TRIAL = "trial"  # a tuning trial ended on this rank: its optimizer steps; see trial()
# Events only the run's fold reads, as one pickle: {"events": bytes, "n": events, and "rows":
# bytes, the rows of summed collectives that only a trace reads, pickled apart}; see
# columns.seal()
SEALED = "sealed"
# A sealed batch's logged values (SCALARS events logging the same names), a column per name;
# only ever inside a sealed event; see columns.seal()
LOGGED = "logged"
TELEMETRY = frozenset({STEP, COMM, PROGRESS, SCALARS, MEMORY, STAGE, PIPELINE, END, STACK,
                       TABLE, DEBUGGER, DDP, TRIAL, SEALED})
#: what a run's record keeps apart from its trace: where ranks were, and what they ran with
UNTIMED = frozenset({STACK, DDP, TRIAL})
#: the high-rate kinds a worker packs into tables; every other kind is sent as it is
TABLED = frozenset({STEP, COMM, MEMORY, STAGE})
#: the kinds a cell's rank seals (:func:`~.columns.seal`): high-rate, and read by nothing in
#: the notebook but the run's fold (not output, input, the debugger's or elastic news)
SEALABLE = frozenset({*TABLED, TABLE, SCALARS, PROGRESS, PIPELINE})
#: what counts as progress for the hang doctor: a step, a collective or a bar moved
PROGRESS_KINDS = frozenset({STEP, COMM, PROGRESS, STAGE, PIPELINE})

Event = dict[str, Any]
Batch = dict[str, Any]

#: seconds between a rank's batches in a small job: the dashboard redraws 4 times a second at
#: most, and every batch costs the rank, the controller and the notebook a message
MIN_INTERVAL = 0.25
#: batches per second the notebook should receive from all ranks together ...
NOTEBOOK_BATCHES_PER_S = 256
#: ... unless that would hold a rank's events back longer than this (seconds)
MAX_INTERVAL = 4.0


def flush_interval(world: int) -> float:
    """Seconds between one rank's batches in a job of ``world`` ranks: :data:`MIN_INTERVAL`
    up to 64 ranks, then growing so the notebook gets about :data:`NOTEBOOK_BATCHES_PER_S`
    batches a second, at most :data:`MAX_INTERVAL`.

    >>> flush_interval(2), flush_interval(64), flush_interval(256), flush_interval(4096)
    (0.25, 0.25, 1.0, 4.0)
    """
    return min(MAX_INTERVAL, max(MIN_INTERVAL, world / NOTEBOOK_BATCHES_PER_S))


#: batches of figures per second the notebook folds from all ranks together, at most: each
#: costs it some 50 µs ...
NOTEBOOK_FOLDS_PER_S = 1024
#: ... unless that would hold a rank's figures back longer than this (seconds): at 16,384
#: ranks, where the dashboard redraws about every 30 s (its redraws may take 3 % of the kernel)
MAX_FIGURES_INTERVAL = 16.0


def figures_interval(world: int) -> float:
    """Seconds between one rank's batches that hold nothing but figures (steps, collectives,
    memory, logged values, bars: the :data:`SEALABLE` kinds, which only the run's fold reads)
    in a job of ``world`` ranks: :func:`flush_interval` up to 4,096 ranks, then growing so
    the notebook folds about :data:`NOTEBOOK_FOLDS_PER_S` of them a second, at most
    :data:`MAX_FIGURES_INTERVAL`. A batch with anything else (output, a warning, elastic
    training's news) goes at :func:`flush_interval`, carrying the figures with it.

    >>> figures_interval(2), figures_interval(4096), figures_interval(8192)
    (0.25, 4.0, 8.0)
    >>> figures_interval(16384), figures_interval(10**6)
    (16.0, 16.0)
    """
    return min(MAX_FIGURES_INTERVAL,
               max(flush_interval(world), world / NOTEBOOK_FOLDS_PER_S))


def stream(name: str, text: str) -> Event:
    return {"kind": STREAM, "name": name, "text": text}


def display(data: dict[str, Any], metadata: Optional[dict[str, Any]] = None,
            display_id: Optional[str] = None, update: bool = False) -> Event:
    """What a rank displayed: ``data`` maps MIME types to content (images base64 text)."""
    return {"kind": DISPLAY, "data": data, "metadata": metadata or {}, "display_id": display_id,
            "update": update}


def warning(category: str, message: str, filename: str, lineno: int) -> Event:
    """A warning a rank's code raised and Python's filters chose to show."""
    return {"kind": WARNING, "category": category, "message": message, "filename": filename,
            "lineno": lineno}


def step(n: int, t0: float, t1: float, *, samples: int = 0, comm_total_s: float = 0.0,
         comm_exposed_s: float = 0.0, comm_bytes: int = 0, buckets: int = 0,
         fwd: Optional[tuple[float, float]] = None, bwd: Optional[tuple[float, float]] = None,
         source: str = "ddp", comm_timed: bool = True) -> Event:
    """A step ``n`` (0-based, per cell) that ran from ``t0`` to ``t1``.

    ``comm_exposed_s`` is the communication time compute did not hide: the wait after the
    last gradient bucket was ready, plus every blocking collective called in the step.
    ``comm_timed=False``: the step all-reduced ``comm_bytes`` of gradients but nothing timed
    that (DDP's own timer times a sample of short steps): its comm times are unknown, not 0.
    """
    return {"kind": STEP, "step": n, "t0": t0, "t1": t1, "samples": samples,
            "comm_total_s": comm_total_s, "comm_exposed_s": comm_exposed_s,
            "comm_bytes": comm_bytes, "buckets": buckets,
            "fwd": list(fwd) if fwd else None, "bwd": list(bwd) if bwd else None,
            "source": source, "comm_timed": comm_timed}


def comm(op: str, t0: float, t1: float, nbytes: int, *, step: Optional[int] = None,
         bucket: Optional[int] = None, dtype: str = "", measured: str = "wire",
         dim: Optional[str] = None, peer: Optional[int] = None,
         mb: Optional[str] = None) -> Event:
    """A collective: ``nbytes`` is the payload handed to it (``measured="bucket"`` when only
    the gradient bucket's size was known, e.g. a hook that bypasses ``torch.distributed``).

    ``dim`` names the device-mesh dimension whose group carried it (``"tp"``, ``"dp"``);
    a point-to-point transfer names its ``peer`` rank and, in a pipeline, the microbatch it
    belongs to (``mb``: ``"F3"`` for the activations of microbatch 3, ``"B3"`` for their
    gradients). Keys that do not apply are left out.
    """
    event = {"kind": COMM, "op": op, "t0": t0, "t1": t1, "bytes": nbytes, "step": step,
             "bucket": bucket, "dtype": dtype, "measured": measured}
    if dim is not None:
        event["dim"] = dim
    if peer is not None:
        event["peer"] = peer
    if mb is not None:
        event["mb"] = mb
    return event


class ElasticWhat(str, Enum):
    """What happened to a rank in an ``nbdist.elastic.run`` call (an elastic event's ``what``).

    ``BEGIN``: ``world``, ``commit``, ``max_failures``. ``FAILED``: a collective failed
    (``error``, ``commit``). ``HEALED``: back in a group (``commit`` restored,
    ``rolled_back`` commits, ``discarded`` optimizer steps, ``seconds``, ``world_before``,
    ``world``, ``failures``, ``joined``: the worker that joined; the joiner's own also says
    ``step``, the job's step its first step is). ``STOPPED``: this rank's own ``error`` ended
    the run.
    """

    BEGIN = "begin"
    FAILED = "failed"
    HEALED = "healed"
    STOPPED = "stopped"


def elastic(what: ElasticWhat, t: float, **info: Any) -> Event:
    """What happened to this rank in an ``nbdist.elastic.run`` call; see :class:`ElasticWhat`
    (on the wire as its plain value, like every field of an event)."""
    return {"kind": ELASTIC, "what": ElasticWhat(what).value, "t": t, **info}


def stage(op: str, mb: int, stage_index: int, t0: float, t1: float) -> Event:
    """Pipeline stage ``stage_index`` ran ``op`` (``"forward"``, ``"backward"`` or ``"weight"``,
    the deferred weight gradient of zero-bubble schedules) on microbatch ``mb``."""
    return {"kind": STAGE, "op": op, "mb": mb, "stage": stage_index, "t0": t0, "t1": t1}


def pipeline(t0: float, t1: float, *, schedule: str, stages: list[int], num_stages: int,
             microbatches: int, busy_s: float, p2p_wait_s: float) -> Event:
    """One ``schedule.step()`` on one rank, from call to return. ``stages`` are the stage
    indices this rank runs, ``busy_s`` the time they spent computing (forward and backward of
    every microbatch), ``p2p_wait_s`` the time blocked waiting for sends and receives. The rest
    of the span is the pipeline's bubble on this rank."""
    return {"kind": PIPELINE, "t0": t0, "t1": t1, "schedule": schedule, "stages": stages,
            "num_stages": num_stages, "microbatches": microbatches, "busy_s": busy_s,
            "p2p_wait_s": p2p_wait_s}


def progress(bar: int, desc: str, n: int, total: Optional[int], t: float,
             done: bool = False) -> Event:
    return {"kind": PROGRESS, "bar": bar, "desc": desc, "n": n, "total": total, "t": t,
            "done": done}


def scalars(values: dict[str, float], t: float, step: Optional[int] = None) -> Event:
    return {"kind": SCALARS, "values": values, "t": t, "step": step}


def memory(t: float, *, params: int, grads: int, optimizer: int, rss: Optional[int],
           peak: Optional[int], device_peak: Optional[int] = None,
           step: Optional[int] = None, model: Optional[dict[str, Any]] = None) -> Event:
    """What this rank holds at ``t``: bytes of parameters, gradients and optimizer state
    (sharded tensors counted by their local shard), the process's resident memory now and
    at its peak, and on a GPU the peak of memory allocated by torch on it.

    ``model`` is what ZeRO's memory model needs of the optimizers stepped in the running cell
    (``runtime/measure/memory.py``): their ``params``, ``grads`` and ``optimizer`` bytes, the
    parameters' elements in full (``elements``), held here (``local_elements``) and with
    optimizer state here (``state_elements``), and how they are split (``sharding``:
    ``"none"``, ``"zero1"``, ``"fsdp2"`` or ``"other"``).
    """
    event = {"kind": MEMORY, "t": t, "params": params, "grads": grads, "optimizer": optimizer,
             "rss": rss, "peak": peak, "device_peak": device_peak, "step": step}
    if model is not None:
        event["model"] = model
    return event


def ddp_model(t: float, *, model: int, params: int, tensors: int, nbytes: int,
              bucket_cap_mb: Optional[float], gradient_as_bucket_view: bool,
              static_graph: bool, comm_hook: Optional[str], applied: list[str],
              explicit: list[str]) -> Event:
    """DDP model number ``model`` of the cell (``params`` elements in ``tensors`` tensors,
    ``nbytes`` of gradients) runs with this setting; ``comm_hook`` names its compression hook
    (``"fp16"``, ``"bf16"``, ``"powersgd"``, another hook's name, or None). ``applied``: the
    knobs nbdist set (the session's or a trial's setting); ``explicit``: those the cell's
    code set itself. Sent again when the cell registers a hook."""
    return {"kind": DDP, "t": t, "model": model, "params": params, "tensors": tensors,
            "bytes": nbytes,
            "bucket_cap_mb": bucket_cap_mb, "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph, "comm_hook": comm_hook, "applied": applied,
            "explicit": explicit}


def trial(t: float, *, steps: int, cut: bool, budget: int) -> Event:
    """A tuning trial ended on this rank after ``steps`` optimizer steps; ``cut``: its
    ``budget`` ended it (else the cell ended first)."""
    return {"kind": TRIAL, "t": t, "steps": steps, "cut": cut, "budget": budget}


def end(ok: bool, t: float, error: Optional[str] = None) -> Event:
    return {"kind": END, "ok": ok, "t": t, "error": error}


def stack(t: float, reason: str, idle_s: float, frames: list[dict[str, Any]], *,
          collective: Optional[dict[str, Any]] = None,
          flight: Optional[list[dict[str, Any]]] = None,
          calls: Optional[dict[str, int]] = None) -> Event:
    """Where this rank's cell was at ``t``: ``reason`` is ``"stall"`` (no progress for
    ``idle_s`` seconds) or ``"interrupt"`` (taken before an interrupt unwound it).

    ``frames`` run outermost first, as a traceback does; each is ``{"file", "line", "name",
    "cell", "code"}`` and the innermost one also has ``"call"``, the call expression it is in
    (``"time.sleep(0.05)"``). ``collective`` is the ``torch.distributed`` call the rank is
    inside by nbdist's own count (``{"op", "seq", "bytes", "dtype", "since"}``: ``seq`` counts
    calls of that op in the cell from 1); ``flight`` is the tail of torch's Flight Recorder
    (``{"group", "op", "seq", "sizes", "dtypes", "state", "done", "p2p"}``; ``seq`` is the
    group's collective number), None where it is not available. ``calls`` counts the
    collectives of each op the cell entered so far.
    """
    return {"kind": STACK, "t": t, "reason": reason, "idle_s": idle_s, "frames": frames,
            "collective": collective, "flight": flight, "calls": calls or {}}



def debugger(state: str, t: float, *, mode: str = "pdb", file: str = "",
             line: Optional[int] = None, func: str = "", text: str = "") -> Event:
    """The rank's debugger at ``t``: ``state`` is ``"enter"`` (it stopped and waits for the
    notebook), ``"leave"`` (it runs again; ``text`` is what it printed since its last prompt)
    or ``"skip"`` (a ``breakpoint()`` it passed, where no one can answer: ``text`` says why).
    ``mode`` is ``"pdb"`` or ``"input"`` (an ``input()`` in the cell); ``file``, ``line`` and
    ``func`` name where the rank stands (the cell's filename, the editor's line)."""
    return {"kind": DEBUGGER, "state": state, "t": t, "mode": mode, "file": file, "line": line,
            "func": func, "text": text}


def input_request(n: int, prompt: str, *, text: str = "", mode: str = "pdb", file: str = "",
                  line: Optional[int] = None, func: str = "") -> Event:
    """The rank's ``n``-th request for a line in this call: ``prompt`` is what the input box
    shows, ``text`` what the debugger printed since its last prompt (shown before it). The
    notebook answers at :func:`answer_key`."""
    return {"kind": INPUT, "n": n, "prompt": prompt, "text": text, "mode": mode, "file": file,
            "line": line, "func": func}


def answer_key(prefix: str, rank: int, n: int) -> str:
    """The store key where the notebook writes the answer to ``rank``'s ``n``-th request of
    the call whose debugger keys start with ``prefix``."""
    return f"{prefix}/{rank}/{n}"
