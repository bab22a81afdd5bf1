"""What a run's numbers mean: at most three plain sentences, each only when the numbers
support it, each stating them. Pure rules over a :class:`~.snapshot.RunSnapshot`.

The rules, in the order they are given (the first three that speak are kept):

1. **exposed** — communication that compute did not hide takes more than
   :data:`EXPOSED_SHARE` of a step: the exposed transfer where the ranks' steps were matched
   (waiting for the slowest rank to arrive is not the network's cost, and no DDP setting cuts
   it; the sentence adds it when it is large), else the exposed time. It says what would cut
   it: the tuned setting for this model when ``--tune`` found one, else ``--tune`` itself.
2. **memory** — what a rank holds next to the ZeRO paper's model for the strategy in use
   (Rajbhandari et al., 2020). With Ψ parameters, ``b`` bytes per parameter (and per
   gradient), ``K`` bytes of optimizer state per parameter and N ranks: DDP holds
   ``(2b + K)·Ψ``; ZeRO-1 divides the optimizer state, ``2b·Ψ + K·Ψ/N``; FSDP2 divides all
   three, ``(2b + K)·Ψ/N``. ``b`` and ``K`` are read from the rank itself (its bytes over its
   elements), Ψ is the parameters' full size. Said for ZeRO-1 and FSDP2 always, for a
   replicated model only when it differs; past :data:`MEMORY_TOLERANCE` the likely reason
   follows (ZeRO-1 hands out whole tensors; parameters left outside ``fully_shard``; ...).
3. **compression** — a compression hook that does not pay: it sent fewer bytes per step than
   the same model's uncompressed run (a named run or a tuning trial, matched by the model's
   parameter and tensor counts) but did not cut the step time by :data:`COMPRESSION_MIN_GAIN`.
4. **imbalance** — one rank's memory peak is :data:`IMBALANCE_RATIO` times the other ranks'
   median and :data:`IMBALANCE_MIN_BYTES` above it (the classic "everything landed on GPU
   0"): the GPU's peak where every rank has one, else the process's peak resident memory.

Timing rules wait for :data:`MIN_STEPS` steps on every rank.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

from .snapshot import ModelMemory, RunSnapshot, RunVerdict
from .units import fmt_bytes, fmt_fraction, fmt_seconds

__all__ = ["COMPRESSION_MIN_GAIN", "EXPOSED_SHARE", "IMBALANCE_MIN_BYTES", "IMBALANCE_RATIO",
           "MAX_VERDICTS", "MEMORY_TOLERANCE", "MIN_STEPS", "NO_CONTEXT", "Context",
           "Reference", "Tuned", "reference", "verdicts"]

#: exposed communication above this share of a step gets a verdict
EXPOSED_SHARE = 0.20
#: measured memory this far from ZeRO's model (either way, as a share of the model's figure)
#: gets its likely reason
MEMORY_TOLERANCE = 0.20
#: a compression hook pays when it cuts the step time by at least this share
COMPRESSION_MIN_GAIN = 0.03
#: one rank's memory peak this many times the others' median, and ...
IMBALANCE_RATIO = 1.3
#: ... at least this many bytes above it, gets a verdict
IMBALANCE_MIN_BYTES = 64 * 2**20
#: steps every rank completed before a timing verdict is given
MIN_STEPS = 5
#: sentences a run gets at most
MAX_VERDICTS = 3
#: the hooks that compress gradients (as a setting names them)
COMPRESSION = ("fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class Reference:
    """Another run a verdict may compare with: a named run or a tuning trial."""

    label: str
    shape: tuple[int, int]  # its DDP model's (parameters, tensors)
    comm_hook: Optional[str]
    step_s: float
    bytes_per_step: Optional[float]


@dataclass(frozen=True)
class Tuned:
    """What ``%%distributed --tune`` found for a model (matched by ``shape``)."""

    shape: tuple[int, int]
    label: str  # the chosen setting, e.g. "bucket_cap_mb=5"
    speedup: Optional[float]  # its samples/s over torch's defaults'
    knobs: tuple[str, ...] = ()  # the knobs it sets


@dataclass(frozen=True)
class Context:
    """What the session knows besides the run: other runs, and what tuning found."""

    references: tuple[Reference, ...] = ()
    tuned: tuple[Tuned, ...] = ()


#: no other run, nothing tuned
NO_CONTEXT = Context()


def reference(label: str, snap: RunSnapshot) -> Optional[Reference]:
    """``snap`` as a reference for other runs' verdicts (None: no DDP model, or too few
    steps to time)."""
    step_s = _step_s(snap)
    if not snap.models or step_s is None:
        return None
    m = snap.models[0]
    return Reference(label, m.shape, m.comm_hook, step_s, _bytes_per_step(snap))


def verdicts(snap: RunSnapshot, context: Context = NO_CONTEXT) -> tuple[RunVerdict, ...]:
    """The run's verdicts, at most :data:`MAX_VERDICTS`, in the rules' order."""
    found = (_exposed(snap, context), _memory(snap), _compression(snap, context),
             _imbalance(snap))
    return tuple(v for v in found if v is not None)[:MAX_VERDICTS]


# ----------------------------------------------------------------- helpers
def _step_s(snap: RunSnapshot) -> Optional[float]:
    steps = [r.step_s for r in snap.ranks if r.step_s is not None]
    return statistics.median(steps) if steps and snap.steps >= MIN_STEPS else None


def _bytes_per_step(snap: RunSnapshot) -> Optional[float]:
    known = [r.bytes_per_step for r in snap.ranks if r.bytes_per_step]
    return statistics.fmean(known) if known else None


def _tuned_for(snap: RunSnapshot, context: Context) -> Optional[Tuned]:
    if not snap.models:
        return None
    shape = snap.models[0].shape
    return next((t for t in reversed(context.tuned) if t.shape == shape), None)


def _mean(xs: Iterable[Optional[float]]) -> Optional[float]:
    known = [x for x in xs if x is not None]
    return statistics.fmean(known) if known else None


# ----------------------------------------------------------------- the rules
def _exposed(snap: RunSnapshot, context: Context) -> Optional[RunVerdict]:
    if snap.steps < MIN_STEPS:
        return None
    d = snap.diagnosis
    waited = ""
    if d.transfer is not None:  # matched steps: the transfer itself, apart from waiting
        share = d.transfer
        if d.waiting is not None and d.waiting >= EXPOSED_SHARE / 4:
            waited = f"; waiting for the slowest rank adds {fmt_fraction(d.waiting)}"
    else:
        share = _mean(r.exposed_fraction for r in snap.ranks)
    if share is None or share <= EXPOSED_SHARE:
        return None
    tuned = _tuned_for(snap, context)
    model = snap.models[0] if snap.models else None
    if model is None:
        remedy = "more compute per step (a larger batch) would hide more of it"
    elif tuned is not None and tuned.knobs and set(tuned.knobs) <= set(model.applied):
        remedy = (f"this is with the tuned setting ({tuned.label}); a larger batch per step, "
                  "or fewer steps that synchronize (no_sync() accumulation), would hide more")
    elif tuned is not None and tuned.knobs:
        kept = sorted(set(tuned.knobs) & set(model.explicit))
        why = (f" (the cell's own {', '.join(kept)} kept it from applying)" if kept else
               "; it applies to DDP models built from now on")
        speed = f", {tuned.speedup:.2f}x torch's defaults' samples/s" if tuned.speedup else ""
        remedy = f"the tuned setting {tuned.label} cuts it{speed}{why}"
    elif tuned is not None:
        remedy = ("`--tune` found no setting faster than torch's defaults for this model; a "
                  "larger batch per step would hide more of it")
    else:
        remedy = ("`%%distributed --tune` on this cell measures bucket sizes, bucket views, "
                  "static graph and compression for this model")
    return RunVerdict("exposed", f"Communication that compute did not hide takes "
                                 f"{fmt_fraction(share)} of each step (over the "
                                 f"{fmt_fraction(EXPOSED_SHARE)} flagged here{waited}): "
                                 f"{remedy}.", (("share", share),))


_STRATEGY = {"zero1": "ZeRO-1", "fsdp2": "FSDP2", "none": "DDP"}


def _predicted(m: ModelMemory, n: int) -> Optional[tuple[float, float, float, float, float]]:
    """ZeRO's model for what ``m`` holds on one of ``n`` ranks: (params, grads, optimizer)
    bytes, and the bytes per parameter ``b`` and of optimizer state ``K`` it used."""
    if not m.elements or not m.local_elements or m.sharding not in _STRATEGY:
        return None
    b = m.params / m.local_elements
    k = m.optimizer / m.state_elements if m.state_elements else 0.0
    psi = m.elements
    opt_share = 1 if m.sharding == "none" else n
    rest_share = n if m.sharding == "fsdp2" else 1
    return b * psi / rest_share, b * psi / rest_share, k * psi / opt_share, b, k


def _memory(snap: RunSnapshot) -> Optional[RunVerdict]:
    n = len(snap.ranks)
    worst = None
    for r in snap.ranks:
        m = r.memory.model if r.memory is not None else None
        pred = _predicted(m, n) if m is not None else None
        if m is None or pred is None:
            continue
        zero1 = m.sharding == "zero1"  # ZeRO-1's promise is about the optimizer state only
        measured = float(m.optimizer if zero1 else m.training)
        model = pred[2] if zero1 else pred[0] + pred[1] + pred[2]
        off = abs(measured - model) / model if model else 0.0
        if worst is None or off > worst[0]:
            worst = (off, r.rank, m, measured, model, pred)
    if worst is None:
        return None
    off, rank, m, measured, model, (_, _, _, b, k) = worst
    if m.sharding == "none" and off <= MEMORY_TOLERANCE:
        return None  # a replicated model holding what it should: nothing to say
    name = _STRATEGY[m.sharding] if snap.models or m.sharding != "none" \
        else "a replicated model"
    psi = m.elements
    if m.sharding == "zero1":
        head = (f"Optimizer state on rank {rank} is {fmt_bytes(measured)}; ZeRO-1's model "
                f"predicts {fmt_bytes(model)} ({k:.3g} B × Ψ = {psi:,} parameters ÷ {n} ranks)")
    else:
        div = f" ÷ {n} ranks" if m.sharding == "fsdp2" else ""
        head = (f"Rank {rank} holds {fmt_bytes(measured)} of parameters, gradients and "
                f"optimizer state; {name}'s model predicts {fmt_bytes(model)} (Ψ = {psi:,} "
                f"parameters × ({b:.3g} + {b:.3g} + {k:.3g}) B{div})")
    text = head + (f", {off:.0%} off: {_memory_reason(m, n, rank)}" if off > MEMORY_TOLERANCE
                   else "")
    return RunVerdict("memory", text + ".", (("rank", rank), ("measured", measured),
                                             ("predicted", model), ("psi", psi),
                                             ("state_per_param", k), ("ranks", n)))


def _memory_reason(m: ModelMemory, n: int, rank: int) -> str:
    share = m.elements / n
    if m.sharding == "zero1":
        return (f"ZeRO-1 gives each rank the state of whole tensors, and rank {rank} got "
                f"{m.state_elements:,} parameters' worth instead of Ψ/{n} = {share:,.0f}")
    if m.sharding == "fsdp2" and m.local_elements > share:
        return (f"rank {rank} holds {m.local_elements:,} parameters instead of Ψ/{n} = "
                f"{share:,.0f}: parameters outside fully_shard stay whole on every rank")
    if not m.grads:
        return "it held no gradients when memory was sampled (zero_grad sets them to None)"
    if m.state_elements < m.local_elements:
        return (f"the optimizer holds state for {m.state_elements:,} of the "
                f"{m.local_elements:,} parameters (frozen, or not stepped yet)")
    return "the optimizer or the model holds tensors the model does not count"


def _compression(snap: RunSnapshot, context: Context) -> Optional[RunVerdict]:
    if not snap.models or snap.models[0].comm_hook not in COMPRESSION:
        return None
    model = snap.models[0]
    step_s, nbytes = _step_s(snap), _bytes_per_step(snap)
    plain = [r for r in context.references
             if r.shape == model.shape and r.comm_hook is None and r.bytes_per_step]
    if step_s is None or not nbytes or not plain:
        return None
    ref = min(plain, key=lambda r: r.step_s)
    assert ref.bytes_per_step is not None
    if nbytes >= ref.bytes_per_step or step_s < ref.step_s * (1 - COMPRESSION_MIN_GAIN):
        return None  # it sent no fewer bytes (nothing to judge), or it paid
    return RunVerdict(
        "compression",
        f"{model.comm_hook} compression does not pay here: it sent "
        f"{fmt_fraction(nbytes / ref.bytes_per_step)} of the bytes of {ref.label!r} "
        f"({fmt_bytes(nbytes)} vs {fmt_bytes(ref.bytes_per_step)} per step) but its step took "
        f"{fmt_seconds(step_s)} vs {fmt_seconds(ref.step_s)}: compressing costs more than the "
        "transfer it saves on this network.",
        (("step_s", step_s), ("reference_step_s", ref.step_s), ("bytes", nbytes),
         ("reference_bytes", ref.bytes_per_step)))


def _imbalance(snap: RunSnapshot) -> Optional[RunVerdict]:
    mems = [(r.rank, r.memory) for r in snap.ranks if r.memory is not None]
    if len(mems) < 2:
        return None
    gpu = all(m.device_peak for _, m in mems)
    peaks = [(rank, m.device_peak if gpu else m.peak) for rank, m in mems]
    if any(p is None for _, p in peaks):
        return None
    rank, top = max(peaks, key=lambda x: x[1] or 0)
    others = statistics.median(p for r, p in peaks if r != rank)
    assert top is not None
    if not others or top < IMBALANCE_RATIO * others or top - others < IMBALANCE_MIN_BYTES:
        return None
    what = "GPU memory peak" if gpu else "peak resident memory"
    return RunVerdict(
        "imbalance",
        f"Rank {rank}'s {what} is {fmt_bytes(top)}, {top / others:.1f}x the other ranks' "
        f"median of {fmt_bytes(others)}: something lands on it alone (tensors created on "
        "one device, evaluation or logging on one rank, a checkpoint gathered there).",
        (("rank", rank), ("peak", top), ("others", others)))
