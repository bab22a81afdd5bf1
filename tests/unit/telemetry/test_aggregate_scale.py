"""The notebook at scale: the fold in pieces, views of a thousand ranks (the workers' batching:
tests/unit/runtime/test_capture.py)."""

from __future__ import annotations

import pickle
import random
from dataclasses import replace

import pytest
from synthetic import T0, ddp_job, stack_sleeping, stack_waiting

from nbdist.display.html import run_summary
from nbdist.display.tables import MAX_OUTLIERS, failure_lines, memory_table, run_table
from nbdist.display.text import format_line, format_summary
from nbdist.telemetry import events as ev
from nbdist.telemetry.aggregate import RunState
from nbdist.telemetry.columns import TRACE_ONLY, pack, rows, seal, unpack, unseal
from nbdist.telemetry.stall.words import where_lines


def job(world: int = 6, steps: int = 12) -> dict[int, list[dict]]:
    """What ``world`` ranks send: DDP steps (rank 2 computes slower), a collective called
    outside the steps, one of a mesh dimension, memory (samples that hold the model and
    ones that hold nothing), logged values, a progress bar and a pipeline stage; rank 1 fails
    at the end, the others finish."""
    compute = {r: 0.010 for r in range(world)}
    compute[2] = 0.016
    out = ddp_job(compute, steps=steps, bucket_bytes=(300, 500, 700))
    for r, evs in out.items():
        evs.insert(5, ev.comm("broadcast", T0 + 0.01, T0 + 0.012 + 0.001 * r, 64))
        evs.insert(7, ev.comm("all_gather", T0 + 0.02, T0 + 0.025, 128, step=1, dim="tp"))
        evs.insert(12, ev.scalars({"loss": 1.0 + 0.1 * r}, T0 + 0.03, 1))
        evs.insert(13, ev.scalars({"loss": 0.9 + 0.1 * r}, T0 + 0.031, 2))
        evs.insert(14, ev.scalars({"loss": 0.8 + 0.1 * r}, T0 + 0.032))  # no step: the next
        evs.insert(14, ev.progress(1, "train", 2, 12, T0 + 0.04))
        evs.insert(20, ev.memory(T0 + 0.05, params=10, grads=10, optimizer=20 + r, rss=1000,
                                 peak=2000, step=2))
        evs.insert(21, ev.stage("forward", 0, 0, T0 + 0.05, T0 + 0.06))
        # samples holding nothing: the first is kept until one holds something, the last
        # (a cell's end, its locals gone) never replaces one that did
        evs.insert(2, ev.memory(T0, params=0, grads=0, optimizer=0, rss=900, peak=900))
        evs.insert(24, ev.memory(T0 + 0.07, params=0, grads=0, optimizer=0, rss=1100,
                                 peak=2100, step=3))
        evs.append(ev.scalars({"loss": 0.5 + 0.1 * r}, T0 + 1, 10))
        evs.append(ev.end(r != 1, T0 + 2, "ValueError: boom" if r == 1 else None))
    return out


def fold(calls: list[list[dict]], world: int) -> RunState:
    state = RunState(range(world))
    for batches in calls:
        state.feed(batches)
        state.snapshot()  # a view looking in between changes nothing
    state.finish()
    return state


def in_pieces(evs: dict[int, list[dict]], rng: random.Random, tables: bool,
              sealed: bool = False) -> list[list[dict]]:
    """Each rank's events cut into batches of random sizes, fed a few at a time in an order
    that mixes the ranks (each rank's own batches in order); ``sealed``: packed and sealed as
    a cell's rank sends them."""
    queues = {}
    for r, es in evs.items():
        cuts, i = [], 0
        while i < len(es):
            n = rng.randint(1, 9)
            part = es[i:i + n]
            cuts.append({"rank": r, "seq": len(cuts) + 1,
                         "events": (seal(pack(part)) if sealed else pack(part) if tables
                                    else part)})
            i += n
        queues[r] = cuts
    calls = []
    while any(queues.values()):
        call = []
        for _ in range(rng.randint(1, 4)):
            r = rng.choice([q for q in queues if queues[q]])
            call.append(queues[r].pop(0))
            if not any(queues.values()):
                break
        calls.append(call)
    return calls


def test_folding_in_pieces_gives_what_folding_at_once_gives():
    evs = job()
    once = fold([[{"rank": r, "seq": 1, "events": es} for r, es in evs.items()]], len(evs))
    snap = once.snapshot()
    assert snap.stragglers == (2,) and snap.failed[0].rank == 1 and len(snap.series) == 12
    assert snap.dims and snap.ranks[0].collectives == 1 and snap.scalar_spread["loss"]
    for seed in range(3):
        rng = random.Random(seed)
        plain = fold(in_pieces(evs, rng, tables=False), len(evs))
        packed = fold(in_pieces(evs, rng, tables=True), len(evs))
        pieces = in_pieces(evs, random.Random(seed), tables=True, sealed=True)
        sealed = fold(pieces, len(evs))
        sealed_events = [x for call in pieces for b in call for e in b["events"]
                         if e["kind"] == ev.SEALED for x in unseal(e)]
        # logged values went as columns where a batch held several, as dicts where one
        assert {ev.LOGGED, ev.SCALARS} <= {e["kind"] for e in sealed_events}
        assert plain.snapshot() == snap
        assert packed.snapshot() == snap
        assert sealed.snapshot() == snap
        assert plain.events() == once.events()
        # a table keeps its events' order; other events of its batch come before it
        assert {r: sorted(map(repr, e)) for r, e in packed.events().items()} == \
            {r: sorted(map(repr, e)) for r, e in once.events().items()}
        # sealed, the trace holds the same events (logged values and bars next to the
        # table they were sealed with), counted the same
        assert {r: sorted(map(repr, e)) for r, e in sealed.events().items()} == \
            {r: sorted(map(repr, e)) for r, e in once.events().items()}
        assert sealed.recorded.held == packed.recorded.held == once.recorded.held


def test_a_trace_keeps_what_tables_carried():
    evs = job(world=2)[0][:-1]
    state = RunState([0])
    state.feed([{"rank": 0, "seq": 1, "events": pack(evs)}])
    assert sorted(map(repr, state.events()[0])) == sorted(map(repr, evs))
    [t] = [e for e in pack(evs) if e["kind"] == ev.TABLE]
    assert list(rows(t)) == [e for e in evs if e["kind"] in ev.TABLED]


@pytest.mark.parametrize("world", [3, 600])
def test_steps_folded_with_their_summed_collectives_give_the_part_by_part_fold(
        world, monkeypatch):
    """A table of steps and the summary of their collectives is folded in one pass, making
    reports only for the steps matched (at 600 ranks one in 2): the snapshot and the trace are
    what folding the two parts one after the other gives, whatever the batches' cuts (a step's
    collectives in one batch and the step in the next take the part-by-part path)."""
    compute = {r: 0.010 for r in range(world)}
    compute[world - 1] = 0.016
    evs = ddp_job(compute, steps=12, bucket_bytes=(300, 500, 700))
    for r, es in evs.items():
        for e in es:  # steps of different sizes
            if e["kind"] == ev.COMM:
                e["bytes"] += 10 * e["step"]
        es.append(ev.scalars({"loss": 0.5 + 0.1 * r}, T0 + 1, 10))
        es.append(ev.end(True, T0 + 2))
    calls = in_pieces(evs, random.Random(world), tables=True)
    taken = []
    summed = RunState._summed_steps

    def counted(self, *a):
        out = summed(self, *a)
        taken.append(out is not None)
        return out

    def fold_all() -> RunState:  # a snapshot now and then (each one visits every rank)
        state = RunState(range(world))
        for i, batches in enumerate(calls):
            state.feed(batches)
            if i % 97 == 0:
                state.snapshot()
        state.finish()
        return state

    monkeypatch.setattr(RunState, "_summed_steps", counted)
    fast = fold_all()
    assert any(taken) and not all(taken)  # both paths ran
    monkeypatch.setattr(RunState, "_summed_steps", lambda self, *a: None)
    slow = fold_all()
    assert fast.snapshot() == slow.snapshot()
    assert fast.snapshot().stragglers == (world - 1,)
    for r in range(world):  # each rank's window, step by step
        a, b = fast._ranks[r], slow._ranks[r]
        for name in ("t0s", "step_s", "samples", "exposed", "step_bytes", "m_index",
                     "m_waiting", "m_transfer", "m_bw"):
            assert list(getattr(a, name)) == list(getattr(b, name)), (r, name)
        assert (a.steps, a.last_step, a.t1, a.comm) == (b.steps, b.last_step, b.t1, b.comm)
    assert fast.events() == slow.events()


def test_a_run_without_a_trace_folds_the_same_and_keeps_no_event():
    evs = job()
    calls = in_pieces(evs, random.Random(7), tables=True)
    kept = fold(calls, len(evs))
    untraced = RunState(range(len(evs)), trace=False)
    for batches in calls:
        untraced.feed(batches)
    untraced.finish()
    assert untraced.snapshot() == kept.snapshot()
    assert untraced.recorded.kept == {} and untraced.events() == {}
    assert untraced.recorded.untraced == sum(len(e) for e in kept.events().values()) > 0


# ----------------------------------------------------------------- views of many ranks
@pytest.fixture(scope="module")
def thousand():
    """1,024 ranks: rank 700 computes slower (the straggler), rank 5 failed. 20 steps: at
    1,024 ranks one step in 4 is matched across ranks, and a straggler is named after 5
    matched steps."""
    world = 1024
    compute = {r: 0.010 for r in range(world)}
    compute[700] = 0.016
    evs = ddp_job(compute, steps=20, bucket_bytes=(1000, 1000))
    state = RunState(range(world))
    for r, es in evs.items():
        es.append(ev.memory(T0 + 1, params=100, grads=100, optimizer=200 + r, rss=10_000 + r,
                            peak=20_000, step=19))
        if r == 5:
            es.append(ev.end(False, T0 + 2, "RuntimeError: out of memory"))
        state.feed([{"rank": r, "seq": 1, "events": pack(es)}])
    return state.snapshot()


def test_a_thousand_ranks_read_as_min_median_max_and_named_outliers(thousand):
    snap = thousand
    assert snap.stragglers == (700,)
    # every step counts in each rank's figures; one in 4 is matched across the ranks
    assert {r.steps for r in snap.ranks} == {20}
    assert [p.step for p in snap.series] == [0, 4, 8, 12, 16]
    header, table_rows = run_table(snap)
    labels = [row.cells[0] for row in table_rows]
    assert labels[:3] == ["min", "median", "max"] and "700" in labels and "5" in labels
    assert len(table_rows) <= 3 + MAX_OUTLIERS + 1
    col = {name: [row.cells[i] for row in table_rows] for i, name in enumerate(header)}
    assert col["compute"][:3] == ["10 ms", "10 ms", "16 ms"]
    assert "straggler" in col["state"][labels.index("700")]
    assert col["state"][1] == "1023 running, 1 failed"
    mem_header, mem_rows = memory_table(snap)
    assert [r.cells[0] for r in mem_rows][:3] == ["min", "median", "max"]
    assert len(mem_rows) <= 3 + MAX_OUTLIERS + 1
    optimizer = mem_header.index("optimizer")
    # one unit per column: the largest value's
    assert [r.cells[optimizer] for r in mem_rows[:3]] == ["0.2 kB", "0.71 kB", "1.22 kB"]
    # the whole summary stays small and readable
    text = format_summary(snap)
    assert len(text.splitlines()) < 30 and "rank 700 is 6 ms/step slower" in text
    markup = run_summary(snap)
    assert len(markup) < 40_000 and markup.count("nbdist-aggregate-row") >= 6
    assert "rank 5 failed: RuntimeError: out of memory" in markup


def test_slowest_ranks_are_named_even_when_nobody_waits_for_them():
    compute = {r: 0.010 for r in range(40)}
    compute[3] = compute[30] = 0.013  # both slower, neither the one the others wait for
    compute[20] = 0.016
    state = RunState(range(40))
    for r, es in ddp_job(compute, steps=8).items():
        state.feed([{"rank": r, "seq": 1, "events": es}])
    rows_by_rank = {row.cells[0]: row for row in run_table(state.snapshot()).rows}
    assert {"3", "20", "30"} <= set(rows_by_rank)
    assert rows_by_rank["3"].cells[-1] == "running, slow: +3 ms/step"


def test_many_failures_with_one_reason_are_one_line():
    state = RunState(range(64))
    state.feed([{"rank": r, "seq": 1, "events": [
        ev.end(False, T0, "NCCL error:\n timeout" if r in (3, 40) else "ValueError: x")]}
        for r in range(64)])
    state.finish()
    lines = failure_lines(state.snapshot())
    assert lines == ["ranks 0-2, 4-39, 41-63 failed: ValueError: x",
                     "ranks 3, 40 failed: NCCL error: timeout"]
    assert len(format_line(state.snapshot())) < 200
    small = RunState(range(2))
    small.feed([{"rank": r, "seq": 1, "events": [ev.end(False, T0, "ValueError: x")]}
                for r in range(2)])
    assert failure_lines(small.snapshot()) == ["rank 0 failed: ValueError: x",
                                               "rank 1 failed: ValueError: x"]


def test_the_hang_doctor_groups_ranks_that_are_in_the_same_place():
    state = RunState(range(64), started=T0)
    for r in range(64):
        stack = stack_sleeping(T0 + 1) if r == 63 else stack_waiting(T0 + 1)
        state.feed([{"rank": r, "seq": 1, "events": [stack]}])
    snap = state.snapshot(at=T0 + 12)
    assert snap.stall is not None and snap.stall.missing == (63,)
    assert where_lines(snap.stall, "In [3]") == [
        "ranks 0-62: waiting in all_reduce (seq 5, float32 [4]) at In [3], line 6: "
        "dist.all_reduce(t) (in torch.distributed.distributed_c10d.all_reduce)",
        "rank 63: in time.sleep(0.05) at In [3], line 5; it never reached the all_reduce the "
        "others wait in"]
    row = next(r for r in run_table(snap).rows if r.cells[0] == "63")
    assert row.cells[-1] == "running · held the others: in time.sleep(0.05) at line 5"
    assert row.held and not row.broken


def test_the_widget_builds_again_only_what_changed(monkeypatch, thousand):
    pytest.importorskip("ipywidgets")
    from nbdist.display import widgets

    built = []
    monkeypatch.setattr(widgets, "charts", lambda snap: built.append("charts") or "c")
    monkeypatch.setattr(widgets, "detail_tables", lambda snap: built.append("details") or "d")
    w = widgets.RunWidget(list(range(1024)))
    w.show(thousand)
    w.show(thousand)  # the same numbers: nothing to build again
    assert built == ["details", "charts"]
    w.show(replace(thousand, series=thousand.series[:-1]))  # a step less: new charts only
    assert built == ["details", "charts", "charts"]


def test_logged_values_sent_as_columns_fold_as_they_do_one_by_one():
    evs = [ev.scalars({"loss": 1.0, "acc": 0.5}, T0, 0),
           ev.scalars({"loss": 0.5, "acc": 0.75}, T0 + 1, 1),
           ev.scalars({"loss": 0.25, "acc": 0.8}, T0 + 2)]  # no step: the one after
    sealed = seal(pack(evs))
    assert [e["kind"] for e in unseal(sealed[0])] == [ev.LOGGED]
    one_by_one, columns = RunState(range(2)), RunState(range(2))
    for r in range(2):
        one_by_one.feed([{"rank": r, "seq": 1, "events": evs}])
        columns.feed([{"rank": r, "seq": 1, "events": sealed}])
    snap = one_by_one.snapshot()
    assert snap.ranks[0].scalars == {"loss": 0.25, "acc": 0.8}
    assert columns.snapshot() == snap
    assert columns.events() == one_by_one.events()


def test_what_only_a_trace_reads_travels_apart_compressed_and_comes_back_in_place():
    # steps with their forward and backward spans, and their bucketed collectives
    evs = ddp_job({0: 0.010}, steps=50, bucket_bytes=(300, 500, 700))[0][:-1]
    evs = [dict(e, fwd=[e["t0"], e["t0"] + 0.004], bwd=[e["t0"] + 0.004, e["t1"]], buckets=3)
           if e["kind"] == ev.STEP else e for e in evs]
    [sealed] = [e for e in seal(pack(evs)) if e["kind"] == ev.SEALED]
    [table] = unseal(sealed)  # as the fold reads it
    step_part = next(p for p in table["parts"] if p["of"] == ev.STEP)
    assert not TRACE_ONLY & set(step_part["fields"])
    assert len(step_part["fields"]) == len(step_part["columns"])
    assert {"step", "t0", "t1", "samples", "comm_exposed_s", "comm_bytes",
            "comm_timed"} <= set(step_part["fields"])
    # compressed: fewer bytes than the same rows pickled
    apart = [p["columns"] for p in unseal(sealed, whole=True)[0]["parts"] if "steps" in p]
    assert len(sealed["rows"]) < len(pickle.dumps(apart, 5)) / 2
    # read whole, every event comes back with its fields in their order
    assert [list(e.items()) for e in unpack([sealed])] == \
        [list(e.items()) for e in evs if e["kind"] in ev.TABLED]
    # and the fold of the sealed batch is the fold of the events
    plain, compact = RunState([0]), RunState([0])
    plain.feed([{"rank": 0, "seq": 1, "events": evs}])
    compact.feed([{"rank": 0, "seq": 1, "events": [sealed]}])
    assert compact.snapshot() == plain.snapshot()
    assert sorted(map(repr, compact.events()[0])) == sorted(map(repr, plain.events()[0]))
