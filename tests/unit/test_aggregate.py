"""Aggregation of telemetry on synthetic event streams: pure, no processes."""

from __future__ import annotations

import pytest

from nbdist.telemetry import events as ev
from nbdist.telemetry.aggregate import RunState, aggregate, find_stragglers
from nbdist.telemetry.intervals import bandwidth, exposed_seconds, rate, union_seconds
from nbdist.telemetry.units import fmt_bytes_rate, fmt_rate, fmt_seconds

T0 = 1_700_000_000.0


def ddp_stream(rank, steps=10, step_s=0.1, compute_s=0.08, bucket_bytes=(400, 600),
               samples=32, t0=T0):
    """Events a DDP rank would send: per step, one comm event per bucket, then the step."""
    out = []
    for n in range(steps):
        s0 = t0 + n * step_s
        ready = s0 + compute_s
        spans = []
        for b, nbytes in enumerate(bucket_bytes):
            a, z = ready - 0.01 + 0.005 * b, ready + (step_s - compute_s) * (b + 1) / 2
            spans.append((a, z))
            out.append(ev.comm("all_reduce", a, z, nbytes, step=n, bucket=b, dtype="float32"))
        out.append(ev.step(n, s0, s0 + step_s, samples=samples,
                           comm_total_s=sum(z - a for a, z in spans),
                           comm_exposed_s=exposed_seconds(ready, spans),
                           comm_bytes=sum(bucket_bytes), buckets=len(bucket_bytes),
                           fwd=(s0, s0 + 0.02), bwd=(s0 + 0.02, ready)))
    return out


def batches(rank, events, per_batch=7):
    return [{"rank": rank, "seq": i // per_batch + 1, "events": events[i:i + per_batch]}
            for i in range(0, len(events), per_batch)]


def test_interval_union_and_exposed_part():
    assert union_seconds([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert union_seconds([(2, 1)]) == 0.0
    # compute ends at 1.5: of comm over [1,2] and [1.8,2.5], 1.0 s is past compute
    assert exposed_seconds(1.5, [(1, 2), (1.8, 2.5)]) == pytest.approx(1.0)
    assert exposed_seconds(5.0, [(1, 2)]) == 0.0  # comm fully hidden


def test_bandwidth_uses_time_any_collective_was_running():
    assert bandwidth(1000, [(0, 0.5), (0.25, 1.0)]) == pytest.approx(1000.0)
    assert bandwidth(0, [(0, 1)]) is None and bandwidth(10, []) is None


def test_rate_from_first_and_last_point():
    assert rate([(0.0, 0), (1.0, 5), (2.0, 20)]) == pytest.approx(10.0)
    assert rate([(1.0, 3)]) is None and rate([(1.0, 1), (1.0, 2)]) is None


def test_steps_per_second_samples_and_exposed_split():
    snap = aggregate(batches(0, ddp_stream(0)) + batches(1, ddp_stream(1)), ranks=[0, 1])
    r0 = snap.ranks[0]
    assert r0.steps == 10 and r0.state == "running"
    assert r0.steps_per_s == pytest.approx(10.0)
    assert r0.samples_per_s == pytest.approx(320.0)
    assert r0.step_s == pytest.approx(0.1)
    # buckets end at ready+0.01 and ready+0.02: 20 ms of the 100 ms step is exposed
    assert r0.exposed_s == pytest.approx(0.02)
    assert r0.exposed_fraction == pytest.approx(0.2)
    p = snap.series[3]
    assert p.step == 3 and p.ranks == 2
    assert p.compute_s + p.exposed_s == pytest.approx(p.step_s)
    assert p.exposed_s == pytest.approx(0.02) and p.nbytes == 1000
    # bucket spans [ready-10ms, ready+10ms] and [ready-5ms, ready+20ms] are busy 30 ms
    assert p.bandwidth == pytest.approx(1000 / 0.03)
    assert r0.bandwidth == pytest.approx(1000 / 0.03)
    assert snap.steps == 10 and snap.comm_bytes == 2 * 10 * 1000 and snap.comm_events == 40


def test_straggler_is_the_rank_with_more_compute_not_the_one_waiting():
    # Rank 2 computes 60 ms; the others compute 30 ms and wait 30 ms in the all-reduce.
    def stream(compute, wait):
        out = []
        for n in range(12):
            s0 = T0 + n * 0.07
            out.append(ev.step(n, s0, s0 + 0.07, samples=8, comm_total_s=wait + 0.01,
                               comm_exposed_s=wait + 0.01))
        return out
    bs = batches(0, stream(0.03, 0.03)) + batches(1, stream(0.03, 0.03)) + \
        batches(2, stream(0.06, 0.0))
    snap = aggregate(bs)
    assert snap.stragglers == (2,)
    assert [r.straggler for r in snap.ranks] == [False, False, True]


def test_no_straggler_on_noise_or_too_few_steps():
    assert find_stragglers({0: [0.010, 0.011, 0.010, 0.012, 0.010],
                            1: [0.011, 0.010, 0.012, 0.010, 0.011]}) == []
    assert find_stragglers({0: [0.01] * 3, 1: [0.05] * 3}) == []  # not enough steps yet
    assert find_stragglers({0: [0.01] * 8, 1: [0.05] * 8}) == [1]
    assert find_stragglers({0: [1e-4] * 8, 1: [3e-4] * 8}) == []  # tiny absolute gap
    assert find_stragglers({0: [0.01] * 8}) == []


def test_progress_merges_and_eta():
    evs = [ev.progress(1, "epoch", n, 100, T0 + n * 0.1) for n in range(0, 50, 10)]
    snap = aggregate(batches(0, evs))
    bar = snap.ranks[0].bar
    assert bar.n == 40 and bar.total == 100 and bar.fraction == pytest.approx(0.4)
    assert bar.rate == pytest.approx(10.0) and bar.eta_s == pytest.approx(6.0)  # 60 left
    # a new bar restarts the rate
    state = RunState([0])
    state.feed(batches(0, evs))
    state.feed([{"rank": 0, "seq": 99, "events": [ev.progress(2, "eval", 1, 10, T0 + 9)]}])
    bar = state.snapshot().ranks[0].bar
    assert bar.desc == "eval" and bar.rate is None and bar.eta_s is None


def test_scalars_failure_and_finish():
    state = RunState([0, 1, 2])
    state.feed([{"rank": 0, "seq": 1, "events": [ev.scalars({"loss": 0.5}, T0, 3),
                                                  ev.scalars({"acc": 0.9}, T0 + 1, 4),
                                                  ev.end(True, T0 + 2)]},
                {"rank": 1, "seq": 1, "events": [ev.progress(1, "", 3, 10, T0),
                                                  ev.end(False, T0 + 2, "ValueError: boom")]},
                {"rank": 2, "seq": 1, "events": [ev.progress(1, "", 2, 10, T0)]}])
    state.finish()
    snap = state.snapshot()
    assert snap.scalars == {"loss": 0.5, "acc": 0.9}
    assert [r.state for r in snap.ranks] == ["done", "failed", "stopped"]
    assert snap.ranks[1].error == "ValueError: boom"
    assert [r.rank for r in snap.failed] == [1] and snap.finished


def test_streams_are_ignored_and_end_alone_is_not_telemetry():
    state = RunState([0])
    changed = state.feed([{"rank": 0, "seq": 1, "events": [ev.stream("stdout", "hi\n"),
                                                            ev.end(True, T0)]}])
    assert changed  # the end event moves the rank to done
    snap = state.snapshot()
    assert not snap.has_telemetry and snap.ranks[0].state == "done"
    assert state.recorded == {}


def test_batches_out_of_order_are_folded_in_sequence():
    evs = ddp_stream(0, steps=4)
    bs = batches(0, evs, per_batch=3)
    snap = aggregate(list(reversed(bs)))
    assert snap.ranks[0].steps == 4 and len(snap.series) == 4


def test_history_is_bounded():
    state = RunState([0], history=5)
    state.feed(batches(0, ddp_stream(0, steps=20)))
    snap = state.snapshot()
    assert [p.step for p in snap.series] == [15, 16, 17, 18, 19]
    assert len(state.events()[0]) == 20 * 3


def test_formatting():
    assert fmt_rate(None) == "-" and fmt_rate(12.34, "it/s") == "12.3 it/s"
    assert fmt_rate(96199.6, "steps/s") == "96.2k steps/s"
    assert fmt_bytes_rate(2.5e9) == "2.5 GB/s" and fmt_bytes_rate(12) == "12 B/s"
    assert fmt_seconds(0.0123) == "12.3 ms" and fmt_seconds(5e-6) == "5 µs"
    assert fmt_seconds(3725) == "1:02:05" and fmt_seconds(125) == "2:05"


def test_snapshot_repr_is_one_line_and_html_escapes():
    state = RunState([0, 1])
    state.feed(batches(0, ddp_stream(0)) + batches(1, ddp_stream(1)))
    state.feed([{"rank": 1, "seq": 99, "events": [ev.end(False, T0 + 5, "Bad <input>")]}])
    snap = state.snapshot()
    assert repr(snap) == "<RunSnapshot: 2 ranks, 10 steps, 10 steps/s, failed: rank 1>"
    html = snap._repr_html_()
    assert "Bad &lt;input&gt;" in html and "<svg" in html and "<table>" in html
