"""Pipelines, mesh dimensions and parameter-server steps on the torch-free parts: the worker's
measurement model, the fold, the trace, the tables and the comparison."""

from __future__ import annotations

import pytest
from synthetic import Sink

from nbdist.display.html import detail_tables, run_summary
from nbdist.display.tables import dims_table, pipeline_table
from nbdist.display.text import format_line, format_summary
from nbdist.records import Comparison
from nbdist.runtime.measure.model import Measurements
from nbdist.telemetry import events as ev
from nbdist.telemetry.aggregate import RunState
from nbdist.telemetry.compare import compare
from nbdist.telemetry.intervals import bubble_fraction
from nbdist.telemetry.trace import chrome_trace

T0 = 1_700_000_000.0


@pytest.fixture
def tel():
    t = Measurements()
    t.begin_cell(Sink())
    return t


# ----------------------------------------------------------------- measurement model
def test_a_pipeline_step_reports_its_compute_and_waits(tel):
    sink = tel.sink
    tel.begin_pipeline_step()
    tel.on_stage("forward", 0, 1, 10.0, 10.2)
    tel.on_collective("recv", 10.2, 10.5, 64, "float32", blocking=False, exposed_s=0.25,
                      peer=0, mb="B0")
    tel.on_stage("backward", 0, 1, 10.5, 10.9)
    tel.on_pipeline_step(10.0, 11.0, schedule="ScheduleGPipe", stages=[1], num_stages=2,
                         microbatches=1)
    [p] = sink.kinds("pipeline")
    assert p["busy_s"] == pytest.approx(0.6) and p["p2p_wait_s"] == pytest.approx(0.25)
    assert [(e["op"], e["mb"], e["stage"]) for e in sink.kinds("stage")] == [
        ("forward", 0, 1), ("backward", 0, 1)]
    tel.on_optimizer_step(begin=True)
    tel.on_optimizer_step(begin=False)
    tel.end_cell()
    [comm] = sink.kinds("comm")
    assert (comm["peer"], comm["mb"], comm["step"]) == (0, "B0", 0)
    [step] = sink.kinds("step")
    assert step["comm_exposed_s"] == pytest.approx(0.25)  # the wait, not the whole transfer


def test_samples_from_a_model_replace_progress_items(tel):
    sink = tel.sink
    tel.on_iteration([1, 2], T0)  # progress item: opens a progress step
    tel.count_samples(32)  # the model saw the batch: progress no longer counts
    tel.on_iteration([1, 2], T0 + 0.5)
    tel.end_step("ps")
    tel.count_samples(16.5)
    tel.end_step("ps")
    tel.end_cell()
    steps = sink.kinds("step")
    assert [(s["samples"], s["source"]) for s in steps] == [(32, "ps"), (16.5, "ps")]
    assert steps[0]["t0"] == T0  # the step began when its batch was fetched


def test_pushes_end_steps_and_their_transfers_belong_to_them(tel):
    sink = tel.sink
    for k in range(3):
        tel.on_collective("ps_pull", T0 + k, T0 + k + 0.1, 40, "float32", blocking=True)
        tel.on_collective("ps_push", T0 + k + 0.5, T0 + k + 0.6, 56, "float32", blocking=True)
        tel.end_step("ps")
    tel.end_cell()
    assert [c["step"] for c in sink.kinds("comm")] == [0, 0, 1, 1, 2, 2]
    assert all(s["comm_exposed_s"] == pytest.approx(0.2) for s in sink.kinds("step"))


def test_dimensions_travel_with_collectives(tel):
    sink = tel.sink
    tel.on_collective("all_reduce", T0, T0 + 0.1, 8, "float32", blocking=False,
                      exposed_s=0.02, dim="tp")
    tel.on_optimizer_step(begin=True)
    tel.on_optimizer_step(begin=False)
    tel.end_cell()
    [comm] = sink.kinds("comm")
    assert comm["dim"] == "tp" and "peer" not in comm
    assert sink.kinds("step")[0]["comm_exposed_s"] == pytest.approx(0.02)


def test_collectives_after_the_last_optimizer_step_make_no_step(tel):
    sink = tel.sink
    tel.on_collective("all_reduce", T0, T0 + 0.1, 8, "float32", blocking=True, dim="tp")
    tel.on_optimizer_step(begin=True)
    tel.on_optimizer_step(begin=False)
    # full_tensor() gathers the trained parameters: not a training step
    tel.on_collective("all_gather_single", T0 + 1, T0 + 1.1, 8, "float32", blocking=True,
                      dim="tp")
    tel.end_cell()
    assert len(sink.kinds("step")) == 1 and tel.steps == 1
    assert [c["op"] for c in sink.kinds("comm")] == ["all_reduce", "all_gather_single"]


# ----------------------------------------------------------------- fold, views, trace
def pipeline_run(microbatches: int, busy: float) -> dict[int, list[dict]]:
    """Two stages, three schedule steps of one second, ``busy`` seconds of compute each."""
    out = {}
    for rank in (0, 1):
        evs = []
        for k in range(3):
            t = T0 + k
            per = busy / (2 * microbatches)
            for m in range(microbatches):
                evs.append(ev.stage("forward", m, rank, t + m * per, t + (m + 1) * per))
                evs.append(ev.stage("backward", m, rank, t + 0.5 + m * per,
                                    t + 0.5 + (m + 1) * per))
                evs.append(ev.comm("send" if rank == 0 else "recv", t + 0.1, t + 0.3, 1024,
                                   step=k, peer=1 - rank, mb=f"F{m}"))
                evs.append(ev.comm("recv" if rank == 0 else "send", t + 0.2, t + 0.4, 1024,
                                   step=k, peer=1 - rank, mb=f"B{m}"))
            evs.append(ev.pipeline(t, t + 1, schedule="ScheduleGPipe", stages=[rank],
                                   num_stages=2, microbatches=microbatches, busy_s=busy,
                                   p2p_wait_s=0.1))
            evs.append(ev.step(k, t, t + 1, samples=8 if rank == 0 else 0, source="optim"))
        out[rank] = evs
    return out


def snapshot(events_by_rank):
    state = RunState([0, 1])
    state.feed([{"rank": r, "seq": 1, "events": evs} for r, evs in events_by_rank.items()])
    return state.snapshot()


def test_the_fold_reports_each_stage_and_the_pipelines_bubble():
    snap = snapshot(pipeline_run(4, busy=0.75))
    for r in snap.ranks:
        p = r.pipeline
        assert p.stages == (r.rank,) and p.label == f"stage {r.rank}/2"
        assert p.bubble == pytest.approx(0.25) and p.microbatches == 4
        assert p.forward_s == pytest.approx(0.75 / 8) and p.step_s == pytest.approx(1.0)
    assert snap.bubble == pytest.approx(0.25)
    assert snap.ranks[1].samples_per_s is None or snap.ranks[1].samples_per_s == 0
    assert bubble_fraction(0.0, 1.0) == 0.0 and bubble_fraction(1.0, 2.0) == 0.0


def test_pipeline_and_dimension_tables_in_text_and_html():
    evs = pipeline_run(2, busy=0.5)
    evs[0].append(ev.comm("all_reduce", T0, T0 + 0.1, 100, step=0, dim="tp"))
    evs[1].append(ev.comm("all_reduce", T0, T0 + 0.3, 100, step=0, dim="tp"))
    snap = snapshot(evs)
    header, rows = pipeline_table(snap)
    assert header[-1] == "bubble" and [row.cells[-1] for row in rows] == ["50%", "50%"]
    [dim] = dims_table(snap).rows
    assert dim.cells[:3] == ("tp", "all_reduce", "2")
    text, html = format_summary(snap), run_summary(snap)
    for out in (text, html):
        assert "ScheduleGPipe" in out and "stage 1/2" in out and "tp" in out
    assert "pipeline bubble 50%" in format_line(snap)
    live = detail_tables(snap)  # what the live dashboard shows under its rows
    assert "stage 0/2" in live and "50%" in live
    plain = snapshot({0: [ev.step(0, T0, T0 + 1, samples=4)]})
    assert pipeline_table(plain) is None and dims_table(plain) is None
    assert "bubble" not in format_summary(plain)


def nested(events: list[dict]) -> bool:
    """Chrome "X" events on one thread must nest or follow each other."""
    stack: list[float] = []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1] <= e["ts"] + 1e-6:
            stack.pop()
        if stack and e["ts"] + e["dur"] > stack[-1] + 1e-6:
            return False
        stack.append(e["ts"] + e["dur"])
    return True


def test_trace_shows_the_schedule_and_transfers_on_lanes_that_nest():
    evs = pipeline_run(2, busy=0.5)
    evs[0].append(ev.comm("all_reduce", T0 + 0.1, T0 + 0.6, 100, step=0, dim="tp"))
    evs[0].append(ev.comm("all_gather_single", T0 + 0.2, T0 + 0.8, 100, step=0, dim="tp"))
    trace = chrome_trace(evs)["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace
               if e["name"] == "thread_name"}
    assert threads[(0, 4)] == "pipeline schedule" and threads[(0, 20)] == "send/recv"
    assert "collectives (2)" in threads.values()  # overlapping collectives get a lane each
    names = [e["name"] for e in trace if e["pid"] == 0 and e["ph"] == "X"]
    assert {"F0", "F1", "B0", "B1", "send F0 → 1", "recv B1 ← 1"} <= set(names)
    assert "ScheduleGPipe (2 microbatches)" in names
    by_thread: dict[tuple, list] = {}
    for e in trace:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    assert all(nested(spans) for spans in by_thread.values())
    calls = [e for e in trace if e.get("cat") == "comm" and e["name"] == "all_reduce"]
    assert calls[0]["args"]["mesh_dim"] == "tp"


def test_compare_has_a_bubble_for_pipelines_only():
    runs = compare({"pipeline": snapshot(pipeline_run(4, busy=0.75)),
                    "ddp": snapshot({0: [ev.step(0, T0, T0 + 1, samples=4)]})})
    assert runs[0].bubble == pytest.approx(0.25) and runs[1].bubble is None
    header, rows = Comparison(runs).table()
    assert "bubble" in header
    assert rows[0].cells[header.index("bubble")] == "25%"
    assert "bubble" not in Comparison(runs[1:]).table().header
