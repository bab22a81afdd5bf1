"""Recorded telemetry as a Chrome trace (JSON object format), for Perfetto or chrome://tracing.

One process track per rank. Inside it: ``steps``, ``forward/backward``, ``pipeline schedule``
(each schedule step with the forward ``F3`` and backward ``B3`` of every microbatch inside),
``collectives`` (calls made in the cell, DTensor's included, with their mesh dimension),
``send/recv`` (a pipeline's transfers, named by microbatch and peer) and as many
``all-reduce`` lanes as overlapping buckets need. Complete ("X") events on one thread must
nest, so spans that overlap without nesting (bucket all-reduces, asynchronous collectives,
a pipeline's sends and receives) are spread over as many lanes as they need.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

from .events import COMM, MEMORY, PIPELINE, PROGRESS, SCALARS, STAGE, STEP, Event
from .intervals import bubble_fraction

# thread ids; bucket lanes count up from 10, send/recv lanes from 20, extra collective lanes
# from 30 (the first collectives lane keeps id 3)
_STEPS, _PHASES, _CALLS, _SCHEDULE, _BUCKETS, _P2P, _MORE_CALLS = 1, 2, 3, 4, 10, 20, 30
_STAGE_LETTER = {"forward": "F", "backward": "B", "weight": "W"}


def _us(t: float, origin: float) -> float:
    return round((t - origin) * 1e6, 3)


def _lanes(spans: Sequence[tuple[float, float]]) -> list[int]:
    """Greedy lane per span so that spans in one lane never overlap."""
    ends: list[float] = []
    out = [0] * len(spans)
    for i in sorted(range(len(spans)), key=lambda k: spans[k][0]):
        a, b = spans[i]
        for lane, end in enumerate(ends):
            if end <= a:
                ends[lane] = b
                out[i] = lane
                break
        else:
            ends.append(b)
            out[i] = len(ends) - 1
    return out


def chrome_trace(events_by_rank: Mapping[int, Sequence[Event]],
                 metadata: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Build the trace dict: ``{"traceEvents": [...], "displayTimeUnit": "ms", ...}``.

    Timestamps are microseconds since the earliest recorded event.
    """
    starts = [e.get("t0", e.get("t")) for evs in events_by_rank.values() for e in evs]
    starts = [t for t in starts if t is not None]
    origin = min(starts) if starts else 0.0
    out: list[dict[str, Any]] = []
    for rank in sorted(events_by_rank):
        evs = events_by_rank[rank]
        pid = rank
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                    "args": {"sort_index": rank}})
        names = {_STEPS: "steps", _PHASES: "forward/backward", _CALLS: "collectives"}
        # Gradient all-reduces: each bucket's, or a step's span from DDP's own timer
        buckets = [e for e in evs if e["kind"] == COMM and (e.get("bucket") is not None
                                                           or e.get("measured") == "ddp")]
        lanes = _lanes([(e["t0"], e["t1"]) for e in buckets])
        for lane in sorted(set(lanes)):
            names[_BUCKETS + lane] = "all-reduce" if lane == 0 else f"all-reduce ({lane + 1})"
        comms = [e for e in evs if e["kind"] == COMM and e.get("bucket") is None
                 and e.get("measured") != "ddp"]
        p2p = [e for e in comms if e.get("peer") is not None]
        calls = [e for e in comms if e.get("peer") is None]
        p2p_lanes = _lanes([(e["t0"], e["t1"]) for e in p2p])
        for lane in sorted(set(p2p_lanes)):
            names[_P2P + lane] = "send/recv" if lane == 0 else f"send/recv ({lane + 1})"
        call_tids = [_CALLS if lane == 0 else _MORE_CALLS + lane
                     for lane in _lanes([(e["t0"], e["t1"]) for e in calls])]
        for tid in sorted(set(call_tids) - {_CALLS}):
            names[tid] = f"collectives ({tid - _MORE_CALLS + 1})"
        if any(e["kind"] in (STAGE, PIPELINE) for e in evs):
            names[_SCHEDULE] = "pipeline schedule"
        for tid, name in names.items():
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                        "args": {"name": name}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                        "args": {"sort_index": tid}})
        for e, lane in zip(buckets, lanes):
            dur = e["t1"] - e["t0"]
            args = {"bytes": e["bytes"], "dtype": e["dtype"], "step": e["step"],
                    "bucket": e["bucket"], "measured": e.get("measured", "wire")}
            if dur > 0:
                args["algbw_MBps"] = round(e["bytes"] / dur / 1e6, 3)
            name = f"bucket {e['bucket']} {e['op']}" if e["bucket"] is not None else \
                f"{e['op']} (all buckets)"
            out.append({"ph": "X", "cat": "comm", "name": name,
                        "pid": pid, "tid": _BUCKETS + lane, "ts": _us(e["t0"], origin),
                        "dur": _us(e["t1"], e["t0"]), "args": args})
        for e, lane in zip(p2p, p2p_lanes):
            arrow = "→" if e["op"] == "send" else "←"
            label = f"{e['op']} {e['mb']} {arrow} {e['peer']}" if e.get("mb") else \
                f"{e['op']} {arrow} {e['peer']}"
            out.append({"ph": "X", "cat": "comm", "name": label, "pid": pid,
                        "tid": _P2P + lane, "ts": _us(e["t0"], origin),
                        "dur": _us(e["t1"], e["t0"]),
                        "args": {"op": e["op"], "bytes": e["bytes"], "dtype": e["dtype"],
                                 "peer": e["peer"], "microbatch": e.get("mb"),
                                 "step": e["step"]}})
        for e, tid in zip(calls, call_tids):
            args = {"bytes": e["bytes"], "dtype": e["dtype"], "step": e["step"]}
            if e.get("dim") is not None:
                args["mesh_dim"] = e["dim"]
            out.append({"ph": "X", "cat": "comm", "name": e["op"], "pid": pid, "tid": tid,
                        "ts": _us(e["t0"], origin), "dur": _us(e["t1"], e["t0"]),
                        "args": args})
        for e in evs:
            kind = e["kind"]
            if kind == STEP:
                out.append({"ph": "X", "cat": "step", "name": f"step {e['step']}", "pid": pid,
                            "tid": _STEPS, "ts": _us(e["t0"], origin),
                            "dur": _us(e["t1"], e["t0"]),
                            "args": {**{k: e[k] for k in (
                                "samples", "comm_total_s", "comm_exposed_s", "comm_bytes",
                                "buckets", "source")},
                                # absent from steps recorded before the field existed
                                "comm_timed": e.get("comm_timed", True)}})
                for name, span in (("forward", e.get("fwd")), ("backward", e.get("bwd"))):
                    if span:
                        out.append({"ph": "X", "cat": "compute", "name": name, "pid": pid,
                                    "tid": _PHASES, "ts": _us(span[0], origin),
                                    "dur": _us(span[1], span[0]), "args": {"step": e["step"]}})
            elif kind == STAGE:
                out.append({"ph": "X", "cat": "compute",
                            "name": f"{_STAGE_LETTER.get(e['op'], e['op'])}{e['mb']}",
                            "pid": pid, "tid": _SCHEDULE, "ts": _us(e["t0"], origin),
                            "dur": _us(e["t1"], e["t0"]),
                            "args": {"op": e["op"], "microbatch": e["mb"],
                                     "stage": e["stage"]}})
            elif kind == PIPELINE:
                span = e["t1"] - e["t0"]
                out.append({"ph": "X", "cat": "pipeline",
                            "name": f"{e['schedule']} ({e['microbatches']} microbatches)",
                            "pid": pid, "tid": _SCHEDULE, "ts": _us(e["t0"], origin),
                            "dur": _us(e["t1"], e["t0"]),
                            "args": {"stages": e["stages"], "num_stages": e["num_stages"],
                                     "busy_s": e["busy_s"], "p2p_wait_s": e["p2p_wait_s"],
                                     "bubble": round(bubble_fraction(span, e["busy_s"]), 4)}})
            elif kind == SCALARS:
                out.append({"ph": "C", "name": "scalars", "pid": pid, "ts": _us(e["t"], origin),
                            "args": dict(e["values"])})
            elif kind == MEMORY:
                out.append({"ph": "C", "name": "memory MB", "pid": pid,
                            "ts": _us(e["t"], origin),
                            "args": {k: round(e[k] / 1e6, 3) for k in
                                     ("params", "grads", "optimizer", "rss") if e.get(k)}})
            elif kind == PROGRESS and e.get("total"):
                out.append({"ph": "C", "name": f"progress {e['desc'] or e['bar']}", "pid": pid,
                            "ts": _us(e["t"], origin), "args": {"n": e["n"]}})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"generator": "nbdist", **dict(metadata or {})}}


def write_trace(path: Union[str, os.PathLike], events_by_rank: Mapping[int, Sequence[Event]],
                metadata: Optional[Mapping[str, Any]] = None) -> int:
    """Write the trace to ``path``; return the number of trace events written."""
    trace = chrome_trace(events_by_rank, metadata)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f, separators=(",", ":"))
    return len(trace["traceEvents"])
