"""Chrome trace files from recorded telemetry: pure, no processes."""

from __future__ import annotations

import json

from nbdist.telemetry import events as ev
from nbdist.telemetry.trace import _lanes, chrome_trace, write_trace

T0 = 1_700_000_000.0


def recorded():
    out = {}
    for rank in (0, 1):
        evs = []
        for n in range(3):
            s0 = T0 + n
            # two buckets whose all-reduces overlap without nesting
            evs.append(ev.comm("all_reduce", s0 + 0.5, s0 + 0.7, 100, step=n, bucket=0,
                               dtype="float16"))
            evs.append(ev.comm("all_reduce", s0 + 0.6, s0 + 0.8, 300, step=n, bucket=1,
                               dtype="float16"))
            evs.append(ev.step(n, s0, s0 + 1, samples=4, comm_total_s=0.4,
                               comm_exposed_s=0.1, comm_bytes=400, buckets=2,
                               fwd=(s0, s0 + 0.2), bwd=(s0 + 0.2, s0 + 0.8)))
        evs.append(ev.comm("broadcast", T0 + 3.1, T0 + 3.2, 8, dtype="float32"))
        evs.append(ev.scalars({"loss": 0.3}, T0 + 3.3))
        out[rank] = evs
    return out


def test_lanes_never_overlap():
    spans = [(0, 2), (1, 3), (2, 4), (2.5, 3)]
    lanes = _lanes(spans)
    for lane in set(lanes):
        mine = sorted(s for s, ln in zip(spans, lanes) if ln == lane)
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:]))
    assert max(lanes) == 2


def test_trace_is_valid_chrome_json_with_a_track_per_rank(tmp_path):
    path = tmp_path / "run.json"
    count = write_trace(path, recorded(), {"world_size": 2})
    trace = json.loads(path.read_text())
    assert set(trace) >= {"traceEvents", "displayTimeUnit"}
    events = trace["traceEvents"]
    assert len(events) == count
    for e in events:
        assert e["ph"] in ("X", "M", "C") and isinstance(e["pid"], int)
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e["tid"], int)
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    for pid in (0, 1):
        mine = [e for e in events if e["pid"] == pid and e["ph"] == "X"]
        assert sum(e["cat"] == "step" for e in mine) == 3
        assert sum(e["name"] == "forward" for e in mine) == 3
        assert sum(e["name"] == "backward" for e in mine) == 3
        buckets = [e for e in mine if e["name"].startswith("bucket")]
        assert len(buckets) == 6 and sum(e["args"]["bytes"] for e in buckets) == 1200
        # overlapping buckets are on different lanes, and "X" events on one lane don't overlap
        by_tid = {}
        for e in buckets:
            by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
        assert len(by_tid) == 2
        for spans in by_tid.values():
            spans.sort()
            assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:]))
        assert any(e["name"] == "broadcast" for e in mine)
    first_step = next(e for e in events if e.get("name") == "step 0" and e["pid"] == 0)
    assert first_step["ts"] == 0 and first_step["dur"] == 1e6
    assert trace["otherData"]["world_size"] == 2


def test_empty_recording_is_still_a_valid_trace():
    trace = chrome_trace({})
    assert trace["traceEvents"] == [] and json.loads(json.dumps(trace))
