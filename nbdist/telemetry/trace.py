"""Recorded telemetry as a Chrome trace (JSON object format), for Perfetto or chrome://tracing.

One process track per rank. Inside it: ``steps``, ``forward/backward``, ``collectives`` (calls
made in the cell) and as many ``all-reduce`` lanes as overlapping buckets need, because complete
("X") events on one thread must nest, and bucket all-reduces overlap without nesting.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

from .events import COMM, MEMORY, PROGRESS, SCALARS, STEP, Event

_STEPS, _PHASES, _CALLS, _BUCKETS = 1, 2, 3, 10  # thread ids; bucket lanes count up from 10


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
        buckets = [e for e in evs if e["kind"] == COMM and e.get("bucket") is not None]
        lanes = _lanes([(e["t0"], e["t1"]) for e in buckets])
        for lane in sorted(set(lanes)):
            names[_BUCKETS + lane] = "all-reduce" if lane == 0 else f"all-reduce ({lane + 1})"
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
            out.append({"ph": "X", "cat": "comm", "name": f"bucket {e['bucket']} {e['op']}",
                        "pid": pid, "tid": _BUCKETS + lane, "ts": _us(e["t0"], origin),
                        "dur": _us(e["t1"], e["t0"]), "args": args})
        for e in evs:
            kind = e["kind"]
            if kind == STEP:
                out.append({"ph": "X", "cat": "step", "name": f"step {e['step']}", "pid": pid,
                            "tid": _STEPS, "ts": _us(e["t0"], origin),
                            "dur": _us(e["t1"], e["t0"]),
                            "args": {k: e[k] for k in ("samples", "comm_total_s",
                                                       "comm_exposed_s", "comm_bytes",
                                                       "buckets", "source")}})
                for name, span in (("forward", e.get("fwd")), ("backward", e.get("bwd"))):
                    if span:
                        out.append({"ph": "X", "cat": "compute", "name": name, "pid": pid,
                                    "tid": _PHASES, "ts": _us(span[0], origin),
                                    "dur": _us(span[1], span[0]), "args": {"step": e["step"]}})
            elif kind == COMM and e.get("bucket") is None:
                out.append({"ph": "X", "cat": "comm", "name": e["op"], "pid": pid,
                            "tid": _CALLS, "ts": _us(e["t0"], origin),
                            "dur": _us(e["t1"], e["t0"]),
                            "args": {"bytes": e["bytes"], "dtype": e["dtype"],
                                     "step": e["step"]}})
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
