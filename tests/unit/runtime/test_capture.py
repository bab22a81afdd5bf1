"""What a rank sends and when (:mod:`nbdist.runtime.capture`): batches less often the larger
the job, tables packed, what cannot wait sent at the next tick, output chunks merged, warnings
as events."""

from __future__ import annotations

import threading
import warnings

import pytest
from synthetic import T0, ddp_job, stack_waiting

from nbdist.backends.base import poll_until
from nbdist.runtime.capture import TICK, EventSink, _coalesce, captured_output
from nbdist.telemetry import events as ev
from nbdist.telemetry.columns import rows
from nbdist.telemetry.events import (
    MAX_INTERVAL,
    MIN_INTERVAL,
    figures_interval,
    flush_interval,
    stream,
)


def test_a_rank_sends_less_often_the_larger_the_job():
    assert flush_interval(1) == flush_interval(16) == MIN_INTERVAL > TICK
    xs = [flush_interval(w) for w in (64, 256, 1024, 4096, 10**6)]
    assert xs == sorted(xs) and xs[-1] == MAX_INTERVAL
    for w in (256, 512, 1024):  # about the same number of batches a second reach the notebook
        assert w / flush_interval(w) == pytest.approx(256)


def test_the_sink_packs_tables_and_sends_what_cannot_wait_at_the_next_tick():
    sent: list[dict] = []
    ticks = threading.Semaphore(0)
    sink = EventSink(0, sent.append, interval=3600)
    sink.on_tick = ticks.release
    try:
        steps = ddp_job({0: 0.01}, steps=3)[0]
        for e in steps:
            sink.emit(e)
        for _ in range(3):  # three ticks pass: the interval has not, so nothing went out
            assert ticks.acquire(timeout=5)
        assert sent == []
        sink.emit(stack_waiting(T0 + 5))  # the hang doctor's report cannot wait
        assert poll_until(lambda: sent, 5, interval=0.01)
        [batch] = sent
        kinds = [e["kind"] for e in batch["events"]]
        assert kinds == ["table", "stack"] and list(rows(batch["events"][0])) == steps
        sink.prompt_output = True  # the rank whose output the notebook shows
        sink.emit(ev.stream("stdout", "epoch 1\n"))
        assert poll_until(lambda: len(sent) == 2, 5, interval=0.01)
        assert sent[1]["events"] == [ev.stream("stdout", "epoch 1\n")]
    finally:
        sink.close()


def test_in_a_large_job_figures_alone_wait_longer_than_output():
    """At 16,384 ranks a rank's figures go every 16 s, its output at the usual 4 s: here
    ticks of 0.1 s, an interval of one tick, and figures every hour."""
    sent: list[dict] = []
    ticks = threading.Semaphore(0)
    sink = EventSink(0, sent.append, interval=TICK, sealed=True, figures_interval=3600)
    sink.on_tick = ticks.release
    try:
        for e in ddp_job({0: 0.01}, steps=3)[0]:
            sink.emit(e)
        for _ in range(5):  # five intervals pass: figures alone stay
            assert ticks.acquire(timeout=5)
        assert sent == []
        sink.emit(ev.stream("stdout", "epoch 1\n"))  # output: at the next interval, with them
        assert poll_until(lambda: sent, 5, interval=0.01)
        assert sorted(e["kind"] for e in sent[0]["events"]) == ["sealed", "stream"]
    finally:
        sink.close()
    assert flush_interval(16384) == MAX_INTERVAL < figures_interval(16384)


def test_a_cells_sink_seals_what_only_the_fold_reads_and_the_fold_reads_it_back():
    """A cell's rank (``sealed=True``): the table with the logged value and the bar, one
    pickle; output and the hang doctor's report travel as they are. Its last batch, carried
    by the call's result (``take``), is sealed too. The fold gives what the unsealed batch
    gives."""
    from nbdist.telemetry.aggregate import RunState
    from nbdist.telemetry.columns import unpack

    steps = ddp_job({0: 0.01}, steps=3)[0]
    evs = [*steps, ev.scalars({"loss": 1.0}, T0 + 1, 2), ev.progress(1, "train", 3, 3, T0 + 1),
           ev.stream("stdout", "done\n"), stack_waiting(T0 + 5)]
    sent: list[dict] = []
    sealed, plain = EventSink(0, sent.append, interval=3600, sealed=True), \
        EventSink(0, sent.append, interval=3600)
    try:
        for sink in (sealed, plain):
            for e in evs:
                sink.emit(e)
            sink.flush()
            for e in evs:
                sink.emit(e)
            sent.append(sink.take())
    finally:
        sealed.close()
        plain.close()
    a, tail, b, _ = sent
    assert [e["kind"] for e in a["events"]] == ["sealed", "stream", "stack"] == \
        [e["kind"] for e in tail["events"]]
    assert a["events"][0]["n"] == len(evs) - 2
    assert [e["kind"] for e in b["events"]] == ["table", "scalars", "progress", "stream", "stack"]
    assert sorted(map(repr, unpack(a["events"]))) == sorted(map(repr, unpack(b["events"]))) \
        == sorted(map(repr, evs))
    folded = [RunState([0]), RunState([0])]
    folded[0].feed([a])
    folded[1].feed([b])
    assert folded[0].snapshot() == folded[1].snapshot()
    assert folded[0].recorded.held == folded[1].recorded.held == len(evs) - 2


def test_coalesce_merges_consecutive_chunks_of_one_stream():
    evs = [stream("stdout", "a"), stream("stdout", "b"), stream("stderr", "c"),
           stream("stdout", "d")]
    assert _coalesce(evs) == [stream("stdout", "ab"), stream("stderr", "c"),
                              stream("stdout", "d")]


def test_warnings_on_a_rank_become_events_not_stderr_text():
    class Sink:
        def __init__(self):
            self.events = []

        def emit(self, e):
            self.events.append(e)

    sink = Sink()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with captured_output(sink):
            warnings.warn("lr is high", UserWarning, stacklevel=1)
    [w] = [e for e in sink.events if e["kind"] == ev.WARNING]
    assert w["category"] == "UserWarning" and w["message"] == "lr is high"
    assert w["filename"] == __file__ and w["lineno"] > 0
    assert not [e for e in sink.events if e["kind"] == ev.STREAM]
