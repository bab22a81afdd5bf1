"""Aggregation of telemetry on synthetic event streams: pure, no processes."""

from __future__ import annotations

import random
import statistics

import pytest
from synthetic import T0, batches, ddp_job, job_batches, stack_sleeping, stack_waiting

from nbdist.telemetry import events as ev
from nbdist.telemetry.aggregate import RunState, aggregate
from nbdist.telemetry.intervals import exposed_seconds
from nbdist.telemetry.matching import RankStep, flagged, match_step, straggler_scores
from nbdist.telemetry.snapshot import SLOWEST


def approx(x):
    """Equal to worker timestamps' precision (about 0.2 µs at today's epoch seconds)."""
    return pytest.approx(x, rel=1e-4, abs=1e-6)


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


def test_steps_per_second_samples_and_exposed_split():
    snap = aggregate(batches(0, ddp_stream(0)) + batches(1, ddp_stream(1)), ranks=[0, 1])
    r0 = snap.ranks[0]
    assert r0.steps == 10 and r0.state == "running"
    assert r0.steps_per_s == approx(10.0)
    assert r0.samples_per_s == approx(320.0)
    assert r0.step_s == approx(0.1)
    # buckets end at ready+0.01 and ready+0.02: 20 ms of the 100 ms step is exposed
    assert r0.exposed_s == approx(0.02)
    assert r0.exposed_fraction == approx(0.2)
    # identical ranks: nobody waits, all exposed time is transfer
    assert r0.waiting_s == approx(0.0) and r0.transfer_s == approx(0.02)
    p = snap.series[3]
    assert p.step == 3 and p.ranks == 2 and p.waited_for is None
    assert p.compute_s + p.exposed_s == approx(p.step_s)
    assert p.exposed_s == approx(0.02) and p.nbytes == 1000
    # bucket spans [ready-10ms, ready+10ms] and [ready-5ms, ready+20ms] are busy 30 ms
    assert p.bandwidth == approx(1000 / 0.03)
    assert r0.bandwidth == approx(1000 / 0.03)
    assert snap.steps == 10 and snap.comm_bytes == 2 * 10 * 1000 and snap.comm_events == 40


def test_straggler_is_the_rank_with_more_compute_not_the_one_waiting():
    # Rank 2 computes 60 ms; the others compute 30 ms and wait 30 ms in the all-reduce.
    def stream(wait):
        out = []
        for n in range(12):
            s0 = T0 + n * 0.07
            out.append(ev.step(n, s0, s0 + 0.07, samples=8, comm_total_s=wait + 0.01,
                               comm_exposed_s=wait + 0.01))
        return out
    bs = batches(0, stream(0.03)) + batches(1, stream(0.03)) + batches(2, stream(0.0))
    snap = aggregate(bs)
    assert snap.stragglers == (2,)
    assert [r.straggler for r in snap.ranks] == [False, False, True]
    assert [round(r.waiting_s, 6) for r in snap.ranks] == [0.03, 0.03, 0.0]
    assert snap.ranks[2].straggler_score == approx(0.03 / 0.07)


def test_no_straggler_on_noise_or_too_few_steps():
    def steps(exposed):  # every rank's step is 10 ms
        return {r: RankStep(0.010, e, e, 100) for r, e in exposed.items()}
    rng = random.Random(1)
    noise = [match_step(n, steps({0: rng.uniform(0, 2e-4), 1: rng.uniform(0, 2e-4)}))
             for n in range(20)]
    assert flagged(straggler_scores(noise, [0, 1]), len(noise)) == []
    slow = [match_step(n, steps({0: 0.004, 1: 0.001})) for n in range(8)]
    assert flagged(straggler_scores(slow[:3], [0, 1]), 3) == []  # not enough steps yet
    assert flagged(straggler_scores(slow, [0, 1]), 8) == [1]
    tiny = [match_step(n, {r: RankStep(1e-3, e, e, 1) for r, e in {0: 4e-4, 1: 1e-4}.items()})
            for n in range(8)]
    assert flagged(straggler_scores(tiny, [0, 1]), 8) == []  # big share, tiny absolute wait
    assert flagged(straggler_scores(slow, [0]), 8) == []


def test_ranks_waited_for_in_turn_are_noise_not_stragglers():
    # A busy machine takes the CPU from one rank, then the other: on 5 ms steps each rank is
    # waited for 2 ms in every other step. Both score 0.2 and cost 1 ms per step; neither is
    # the rank the others keep waiting for.
    def step(n, late):
        return match_step(n, {r: RankStep(0.005, 0.0025 if r != late else 0.0005, 0.002, 100)
                              for r in (0, 1)})
    turns = [step(n, n % 2) for n in range(20)]
    scores = straggler_scores(turns, [0, 1])
    assert scores[0].score == approx(0.2) and scores[1].score == approx(0.2)
    assert flagged(scores, len(turns)) == []
    # one rank waited for more than the other, by more than the thresholds, is flagged
    mostly_1 = [step(n, 1 if n % 10 else 0) for n in range(20)]
    assert flagged(straggler_scores(mostly_1, [0, 1]), 20) == [1]
    # two slow ranks of eight are both named: each is measured against the median rank
    eight = [match_step(n, {r: RankStep(0.010, 0.001 if r == n % 2 else 0.004, 0.001, 100)
                            for r in range(8)}) for n in range(20)]
    assert flagged(straggler_scores(eight, list(range(8))), 20) == [0, 1]


def test_one_slow_rank_splits_exposed_time_into_waiting_and_transfer():
    # Rank 1 computes 15 ms per step, rank 0 10 ms: rank 0 waits 5 ms for it in the last
    # bucket's all-reduce, then both spend 2 ms in the transfer (see synthetic.ddp_job).
    snap = aggregate(job_batches(ddp_job({0: 0.010, 1: 0.015}, steps=10)))
    r0, r1 = snap.ranks
    assert r0.step_s == approx(0.017) and r1.step_s == approx(0.017)
    assert r0.compute_s == approx(0.010) and r1.compute_s == approx(0.015)
    assert r0.waiting_s == approx(0.005) and r1.waiting_s == approx(0.0)
    assert r0.transfer_s == approx(0.002) and r1.transfer_s == approx(0.002)
    assert r0.exposed_s == approx(r0.waiting_s + r0.transfer_s)
    # the rank everyone waits for is named, with its compute time
    assert snap.stragglers == (1,) and r1.straggler and not r0.straggler
    assert r1.straggler_score == approx(0.005 / 0.017) and r0.straggler_score == 0
    d = snap.diagnosis
    assert d.waited_for == 1 and d.compute_s == approx(0.015)
    assert d.slower_by_s == approx(0.005)
    assert d.waiting == approx(0.005 / 0.017)  # rank 0's share: the others wait
    assert d.transfer == approx(0.002 / 0.017)
    # One bandwidth: 2000 bytes over the transfer time, the 4 ms rank 1 (which waited for
    # nobody) spent in the two all-reduces; rank 0's 11.5 ms include its waiting.
    bw = 2000 / 0.004
    assert r0.bandwidth == approx(bw) and r1.bandwidth == approx(bw)
    assert snap.bandwidth == approx(bw) and d.bandwidth == approx(bw)
    assert all(p.bandwidth == approx(bw) for p in snap.series)
    p = snap.series[4]
    assert p.waited_for == 1 and p.ranks == 2
    assert p.waiting_s == approx(0.0025) and p.transfer_s == approx(0.002)
    assert p.compute_s + p.exposed_s == approx(p.step_s)


def test_a_rank_only_2ms_slower_is_still_named():
    snap = aggregate(job_batches(ddp_job({0: 0.016, 1: 0.018, 2: 0.016}, steps=12)))
    assert snap.stragglers == (1,)
    assert snap.diagnosis.slower_by_s == approx(0.002)
    assert snap.ranks[0].waiting_s == approx(0.002)


def test_outliers_are_stragglers_failed_ranks_and_the_few_slowest():
    compute = {r: 0.010 for r in range(40)}
    compute[20] = 0.016  # the one the others wait for
    compute[3] = compute[30] = 0.013
    compute[11] = 0.012  # slow too, but the fourth slowest: not named
    compute[7] = 0.0104  # 0.4 ms slower: under the 1 ms floor
    job = ddp_job(compute, steps=8)
    job[5].append(ev.end(False, T0 + 2, "RuntimeError: out of memory"))
    state = RunState(range(40))
    for r, es in job.items():
        state.feed([{"rank": r, "seq": 1, "events": es}])
    snap = state.snapshot()
    assert snap.stragglers == (20,)
    assert [(o.rank.rank, o.why) for o in snap.outliers()] == [
        (3, "slow"), (5, "broken"), (20, "straggler"), (30, "slow")]
    assert SLOWEST == 3 and snap.ranks[11].slower_by_s == approx(0.002)


def test_a_rank_away_from_the_collective_the_others_wait_in_is_stalled():
    state = RunState([0, 1], started=T0)
    state.feed([{"rank": 0, "seq": 1, "events": [stack_waiting(T0 + 1)]}])
    state.feed([{"rank": 1, "seq": 1, "events": [stack_sleeping(T0 + 1)]}])
    assert state.snapshot(at=T0 + 5).outliers() == ()  # under the threshold: no verdict yet
    assert [(o.rank.rank, o.why) for o in state.snapshot(at=T0 + 12).outliers()] == [
        (1, "stalled")]


def test_clock_skew_between_hosts_moves_nothing():
    job = {0: 0.010, 1: 0.015, 2: 0.010}
    plain = aggregate(job_batches(ddp_job(job)))
    skewed = aggregate(job_batches(ddp_job(job, skew={1: 3.7, 2: -1.2})))
    for a, b in zip(plain.ranks, skewed.ranks):
        assert (a.waiting_s, a.transfer_s) == approx((b.waiting_s, b.transfer_s))
        assert a.bandwidth == approx(b.bandwidth)
    assert plain.stragglers == skewed.stragglers == (1,)


def test_steps_wait_for_every_rank_before_they_are_split():
    job = ddp_job({0: 0.010, 1: 0.015}, steps=6)
    state = RunState([0, 1])
    state.feed(batches(0, job[0]))
    snap = state.snapshot()
    assert snap.ranks[0].steps == 6 and snap.series == ()  # rank 1 has reported nothing
    assert snap.ranks[0].waiting_s is None and snap.ranks[0].compute_s == approx(0.010)
    state.feed(batches(1, job[1][:9]))  # rank 1's first 3 steps
    assert [p.step for p in state.snapshot().series] == [0, 1, 2]
    # rank 1 fails: the steps it will never report are split among the ranks that did
    state.feed([{"rank": 1, "seq": 50, "events": [ev.end(False, T0 + 1, "boom")]}])
    assert [p.step for p in state.snapshot().series] == list(range(6))
    assert state.snapshot().series[-1].ranks == 1


def test_a_rank_with_an_untimed_bucket_is_not_taken_for_the_last_to_arrive():
    # a GPU bucket whose events had not completed: rank 1 reports too little exposed time
    reports = {0: RankStep(0.02, 0.004, 0.006, 100), 1: RankStep(0.02, 0.0, 0.0, 100, False),
               2: RankStep(0.02, 0.009, 0.011, 100)}
    m = match_step(0, reports)
    assert m.last == 0 and m.transfer_s == 0.004
    assert m.waiting[2] == approx(0.005) and m.waiting[1] == 0.0


def test_collectives_outside_steps_are_matched_by_order():
    # rank 0 enters each all_reduce 3 ms before rank 1; both then spend 1 ms transferring
    def calls(early):
        out = []
        for k in range(4):
            t = T0 + k
            out.append(ev.comm("all_reduce", t, t + 0.001 + (0.003 if early else 0), 4000))
            out.append(ev.comm("broadcast", t + 0.5, t + 0.502, 80))
        return out
    snap = aggregate(batches(0, calls(True)) + batches(1, calls(False), per_batch=3))
    r0, r1 = snap.ranks
    assert r0.collectives == r1.collectives == 8
    assert r0.collective_waiting_s == approx(4 * 0.003)
    assert r1.collective_waiting_s == approx(0.0)
    assert r0.collective_transfer_s == approx(4 * 0.001 + 4 * 0.002)
    assert r0.bandwidth == r1.bandwidth  # one definition: bytes over transfer time
    assert snap.has_telemetry and r0.steps == 0


def test_progress_merges_and_eta():
    evs = [ev.progress(1, "epoch", n, 100, T0 + n * 0.1) for n in range(0, 50, 10)]
    snap = aggregate(batches(0, evs))
    bar = snap.ranks[0].bar
    assert bar.n == 40 and bar.total == 100 and bar.fraction == approx(0.4)
    assert bar.rate == approx(10.0) and bar.eta_s == approx(6.0)  # 60 left
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
    assert state.recorded.kept == {}


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


def test_snapshot_repr_is_one_line():
    state = RunState([0, 1])
    state.feed(batches(0, ddp_stream(0)) + batches(1, ddp_stream(1)))
    state.feed([{"rank": 1, "seq": 99, "events": [ev.end(False, T0 + 5, "Bad <input>")]}])
    snap = state.snapshot()
    assert repr(snap) == "<RunSnapshot: 2 ranks, 10 steps, 10 steps/s, failed: rank 1>"


def test_a_rank_far_behind_the_others_does_not_break_the_fold():
    # Asynchronous training (a parameter server): rank 0 takes hundreds of steps while rank 1
    # takes a few; steps rank 1 reports after they were given up on are simply not matched.
    state = RunState([0, 1], history=20)
    for n in range(60):
        state.feed([{"rank": 0, "seq": n + 1, "events": [
            ev.step(n, T0 + n, T0 + n + 0.5, comm_exposed_s=0.1)]}])
    for n in range(3):
        state.feed([{"rank": 1, "seq": n + 1, "events": [
            ev.step(n, T0 + 10 * n, T0 + 10 * n + 5, comm_exposed_s=0.1)]}])
    snap = state.snapshot()
    assert [r.steps for r in snap.ranks] == [60, 3]


def _sampled(job, timed_steps):
    """What workers send when DDP's timer timed only ``timed_steps``: the other steps carry
    their bytes and ``comm_timed=False``, and no collectives."""
    out = {}
    for r, events in job.items():
        keep = []
        for e in events:
            if e["step"] in timed_steps:
                keep.append(e)
            elif e["kind"] == "step":
                keep.append({**e, "comm_total_s": 0.0, "comm_exposed_s": 0.0, "bwd": None,
                             "comm_timed": False})
        out[r] = keep
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["events", "tables"])
def test_untimed_steps_count_their_bytes_but_not_as_exposed_time_or_matched_steps(packed):
    from nbdist.telemetry.columns import pack

    job = ddp_job({0: 0.03, 1: 0.06}, steps=30)  # rank 1 is the straggler
    full = aggregate(job_batches(job))
    timed = set(range(0, 30, 3))
    bs = job_batches(_sampled(job, timed))
    if packed:
        bs = [{**b, "events": pack(b["events"])} for b in bs]
    snap = aggregate(bs)
    assert snap.steps == full.steps == 30
    assert snap.comm_bytes == full.comm_bytes == 2 * 30 * 2000  # every step's, timed or not
    # only timed steps are matched across ranks
    assert [p.step for p in snap.series] == sorted(timed)
    for r in (0, 1):
        mine, truth = snap.ranks[r], full.ranks[r]
        assert mine.step_s == approx(truth.step_s)  # every step's length
        assert mine.bytes_per_step == approx(truth.bytes_per_step)
        # exposed time: the timed steps' own (not diluted by zeros for the others)
        assert mine.exposed_s == approx(statistics.fmean(
            e["comm_exposed_s"] for e in job[r] if e["kind"] == "step" and e["step"] in timed))
    # the straggler is still found from the timed steps
    assert snap.stragglers == full.stragglers == (1,)
    assert snap.ranks[0].waiting_s == approx(full.ranks[0].waiting_s)
