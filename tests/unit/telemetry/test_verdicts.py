"""The verdicts under a run's summary: each rule speaks only when the numbers support it, states
them, and at most three are given. Pure, on synthetic runs."""

from __future__ import annotations

from dataclasses import replace

import pytest
from synthetic import T0, ddp_job, job_batches

from nbdist.display.html import run_summary
from nbdist.display.text import format_summary
from nbdist.records import Comparison
from nbdist.telemetry import events as ev
from nbdist.telemetry.aggregate import RunState
from nbdist.telemetry.compare import compare
from nbdist.telemetry.snapshot import ModelMemory
from nbdist.telemetry.verdicts import (
    EXPOSED_SHARE,
    IMBALANCE_MIN_BYTES,
    MAX_VERDICTS,
    Context,
    Reference,
    Tuned,
    reference,
    verdicts,
)

MB = 2**20


def model_event(params=1000, tensors=4, hook=None, applied=(), explicit=()):
    return ev.ddp_model(T0, model=0, params=params, tensors=tensors, nbytes=4 * params,
                        bucket_cap_mb=25.0,
                        gradient_as_bucket_view=False, static_graph=False, comm_hook=hook,
                        applied=list(applied), explicit=list(explicit))


def memory_event(params, grads, optimizer, *, elements, local, state, sharding,
                 peak=400 * MB, device_peak=None):
    """A rank's memory sample: the cell's optimizers hold these bytes (and an older one
    another megabyte, which the model leaves out)."""
    model = {"params": params, "grads": grads, "optimizer": optimizer, "elements": elements,
             "local_elements": local, "state_elements": state, "sharding": sharding}
    return ev.memory(T0 + 5, params=params + MB, grads=grads, optimizer=optimizer, rss=peak,
                     peak=peak, device_peak=device_peak, model=model)


def snapshot(compute=(0.05, 0.05), transfer=0.002, bucket_bytes=(1000, 1000), extra=None,
             steps=10):
    """A finished 2-rank DDP run: ``compute`` per rank and step, ``transfer`` per bucket;
    ``extra``: more events per rank."""
    job = ddp_job(dict(enumerate(compute)), steps=steps, transfer=transfer,
                  bucket_bytes=bucket_bytes)
    for r, evs in (extra or {}).items():
        job[r] = list(evs) + job[r]
    state = RunState(sorted(job))
    state.feed(job_batches(job))
    return state.snapshot()


def rules(found):
    return [v.rule for v in found]


# ----------------------------------------------------------------- exposed communication
def test_heavy_exposed_communication_gets_a_verdict_with_its_share_and_try_tune():
    snap = snapshot(compute=(0.004, 0.004), transfer=0.01,
                    extra={0: [model_event()], 1: [model_event()]})
    [v] = verdicts(snap)
    assert v.rule == "exposed" and v.figure("share") > EXPOSED_SHARE
    assert f"{v.figure('share'):.0%}" in v.text and "--tune" in v.text


def test_a_compute_bound_run_gets_no_verdict():
    snap = snapshot(compute=(0.2, 0.2), transfer=0.0005,
                    extra={0: [model_event()], 1: [model_event()]})
    assert verdicts(snap) == ()


def test_waiting_for_a_straggler_is_not_blamed_on_the_network():
    # rank 1 computes twice as long: rank 0 waits, but the transfer itself is small
    snap = snapshot(compute=(0.05, 0.1), transfer=0.0005)
    assert snap.stragglers == (1,)
    assert "exposed" not in rules(verdicts(snap))


def test_the_exposed_verdict_names_the_tuned_setting_for_this_model():
    tuned = Tuned((1000, 4), "bucket_cap_mb=5", 1.3, ("bucket_cap_mb",))
    plain = snapshot(compute=(0.004, 0.004), transfer=0.01,
                     extra={r: [model_event()] for r in (0, 1)})
    [v] = verdicts(plain, Context(tuned=(tuned,)))
    assert "the tuned setting bucket_cap_mb=5 cuts it, 1.30x" in v.text
    with_it = snapshot(compute=(0.004, 0.004), transfer=0.01,
                       extra={r: [model_event(applied=["bucket_cap_mb"])] for r in (0, 1)})
    [v] = verdicts(with_it, Context(tuned=(tuned,)))
    assert "this is with the tuned setting (bucket_cap_mb=5)" in v.text
    other = Tuned((999, 4), "bucket_cap_mb=5", 1.3, ("bucket_cap_mb",))  # another model
    [v] = verdicts(plain, Context(tuned=(other,)))
    assert "--tune" in v.text


# ----------------------------------------------------------------- memory and ZeRO's model
PSI = 1000  # parameters; fp32 (4 B), Adam (8 B of state each)


def zero1(state_elements=(500, 500)):
    return {r: [memory_event(4 * PSI, 4 * PSI, 8 * s, elements=PSI, local=PSI, state=s,
                             sharding="zero1"), model_event()]
            for r, s in enumerate(state_elements)}


def test_zero1_optimizer_state_is_compared_with_the_formula():
    [v] = verdicts(snapshot(extra=zero1()))
    assert v.rule == "memory"
    assert v.figure("predicted") == pytest.approx(8 * PSI / 2)  # K·Ψ/N
    assert v.figure("measured") == pytest.approx(8 * 500)
    assert "ZeRO-1's model predicts 4 kB" in v.text and "Ψ = 1,000" in v.text
    assert "off" not in v.text  # as predicted: no reason needed


def test_zero1_that_partitions_whole_tensors_unevenly_says_so():
    [v] = verdicts(snapshot(extra=zero1((800, 200))))
    assert v.figure("rank") == 0 and v.figure("measured") == pytest.approx(8 * 800)
    assert "60% off" in v.text and "whole tensors" in v.text and "800" in v.text


def test_fsdp2_divides_all_three_and_names_parameters_left_whole():
    even = {r: [memory_event(2 * PSI, 2 * PSI, 4 * PSI, elements=PSI, local=PSI // 2,
                             state=PSI // 2, sharding="fsdp2")] for r in (0, 1)}
    [v] = verdicts(snapshot(extra=even))
    assert v.figure("predicted") == pytest.approx((4 + 4 + 8) * PSI / 2)
    assert "FSDP2's model" in v.text and "off" not in v.text
    uneven = {r: [memory_event(4 * 900, 4 * 900, 8 * 900, elements=PSI, local=900, state=900,
                               sharding="fsdp2")] for r in (0, 1)}
    [v] = verdicts(snapshot(extra=uneven))
    assert "outside fully_shard" in v.text


def test_ddp_memory_is_said_only_when_it_differs_from_the_model():
    exact = {r: [memory_event(4 * PSI, 4 * PSI, 8 * PSI, elements=PSI, local=PSI, state=PSI,
                              sharding="none"), model_event()] for r in (0, 1)}
    assert "memory" not in rules(verdicts(snapshot(extra=exact)))
    freed = {r: [memory_event(4 * PSI, 0, 8 * PSI, elements=PSI, local=PSI, state=PSI,
                              sharding="none"), model_event()] for r in (0, 1)}
    [v] = verdicts(snapshot(extra=freed))
    assert "DDP's model" in v.text and "no gradients" in v.text


# ----------------------------------------------------------------- compression
def test_compression_that_does_not_pay_is_named_with_bytes_and_step_times():
    fp16 = snapshot(compute=(0.05, 0.05), bucket_bytes=(500, 500),
                    extra={r: [model_event(hook="fp16")] for r in (0, 1)})
    faster_plain = Reference("ddp", (1000, 4), None, 0.04, 2000.0)
    [v] = verdicts(fp16, Context(references=(faster_plain,)))
    assert v.rule == "compression" and "fp16 compression does not pay" in v.text
    assert "50% of the bytes of 'ddp'" in v.text
    slower_plain = replace(faster_plain, step_s=0.2)
    assert verdicts(fp16, Context(references=(slower_plain,))) == ()  # it paid
    other_model = replace(faster_plain, shape=(5, 1))
    assert verdicts(fp16, Context(references=(other_model,))) == ()  # nothing to compare


def test_a_run_is_a_reference_for_others_by_its_model_and_hook():
    snap = snapshot(extra={r: [model_event(hook="fp16")] for r in (0, 1)})
    ref = reference("fp16", snap)
    assert ref is not None and ref.shape == (1000, 4) and ref.comm_hook == "fp16"
    assert ref.bytes_per_step == 2000 and ref.step_s == pytest.approx(0.052)
    assert reference("none", snapshot()) is None  # no DDP model: nothing to match


# ----------------------------------------------------------------- imbalance
def test_one_rank_holding_much_more_memory_is_named():
    def mem(peak):
        return [ev.memory(T0 + 5, params=1, grads=1, optimizer=0, rss=peak, peak=peak)]

    [v] = verdicts(snapshot(compute=(0.05,) * 3, extra={0: mem(2000 * MB), 1: mem(500 * MB),
                                                        2: mem(520 * MB)}))
    assert v.rule == "imbalance" and v.figure("rank") == 0 and "3.9x" in v.text
    close = {0: mem(500 * MB + IMBALANCE_MIN_BYTES // 2), 1: mem(500 * MB), 2: mem(500 * MB)}
    assert verdicts(snapshot(compute=(0.05,) * 3, extra=close)) == ()


# ----------------------------------------------------------------- together
def test_at_most_three_verdicts_and_the_summary_shows_them():
    extra = zero1((900, 100))
    for r in (0, 1):
        extra[r] = [e if e["kind"] != "ddp" else model_event(hook="fp16") for e in extra[r]]
    extra[0].append(ev.memory(T0 + 6, params=1, grads=1, optimizer=0, rss=9000 * MB,
                              peak=9000 * MB))
    snap = snapshot(compute=(0.004, 0.004), transfer=0.01, extra=extra)
    ctx = Context(references=(Reference("ddp", (1000, 4), None, 0.001, 1e9),))
    found = verdicts(snap, ctx)
    assert len(found) == MAX_VERDICTS and rules(found) == ["exposed", "memory", "compression"]
    snap = replace(snap, verdicts=found)
    text, html = format_summary(snap), run_summary(snap)
    assert text.count("verdict: ") == 3 and "nbdist-verdicts" in html
    assert html.count("<code>%%distributed --tune</code>") == 1  # as code, once
    assert all(v.text.endswith(".") for v in found)


def test_compare_has_a_verdicts_column_judged_against_the_other_runs():
    plain = snapshot(compute=(0.01, 0.01), extra={r: [model_event()] for r in (0, 1)})
    fp16 = snapshot(compute=(0.02, 0.02), bucket_bytes=(500, 500),
                    extra={r: [model_event(hook="fp16")] for r in (0, 1)})
    c = Comparison(compare({"ddp": plain, "fp16": fp16}))
    assert [rule for rule, _ in c.runs[1].verdicts] == ["compression"]
    frame = c.to_pandas()
    assert "does not pay" in frame.loc["fp16", "verdicts"] and frame.loc["ddp", "verdicts"] == ""
    assert "fp16: fp16 compression does not pay" in repr(c)
    assert "compression" in c._repr_html_()


def test_memory_points_carry_what_the_model_needs():
    snap = snapshot(extra=zero1())
    m = snap.ranks[0].memory
    assert m is not None and m.params == 4 * PSI + MB  # what the rank holds, all of it
    assert m.model == ModelMemory(4 * PSI, 4 * PSI, 8 * 500, PSI, PSI, 500, "zero1")
