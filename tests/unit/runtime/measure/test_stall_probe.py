"""The hang doctor on a worker, in this process: stacks of a real thread running a cell, the
collective it is in, the interrupt hooks, and the Flight Recorder's dump as torch writes it."""

from __future__ import annotations

import gc
import pickle
import signal
import sys
import threading
import time
import types
import weakref

import pytest
from synthetic import Sink

from nbdist.backends.base import poll_until
from nbdist.runtime import interrupt
from nbdist.runtime.execute import run_code
from nbdist.runtime.measure import stall_probe
from nbdist.runtime.measure.stall_probe import Watch, call_text, flight_recorder, stack_frames
from nbdist.telemetry.events import STACK

CELL = "<distributed cell 3>"
# line 4 sleeps in small steps until told to stop; line 6 is inside a function the cell defines
SOURCE = """\
import time
def wait(flag):
    while not flag.is_set():
        time.sleep(0.01)
flag = FLAG
wait(flag)
"""


class CellThread:
    """Runs SOURCE as a cell on a thread of its own, watched by ``watch`` while it runs."""

    def __init__(self, watch: Watch, sink: Sink, stall_after: float = 0.2, enter: bool = False):
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.watch, self.sink, self.stall_after, self.enter = watch, sink, stall_after, enter
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.watch.begin(self.sink, CELL, True, self.stall_after)
        if self.enter:  # as the collective wrappers do when the cell calls one
            self.watch.enter("all_reduce", 16, "float32", time.time())
        self.ready.set()
        try:
            run_code(SOURCE, CELL, {"FLAG": self.stop})
        finally:
            self.watch.end()

    def __enter__(self) -> CellThread:
        self.thread.start()
        self.ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)


def stacks(sink: Sink) -> list[dict]:
    return sink.kinds(STACK)


def test_a_stalled_cell_is_sampled_once_per_place_with_its_cell_lines():
    sink, watch = Sink(), Watch()
    with CellThread(watch, sink) as cell:
        watch.tick()
        assert stacks(sink) == []  # no progress for less than half the threshold: too early
        assert poll_until(lambda: watch.tick() or bool(stacks(sink)), 5, interval=0.02)
        [e] = stacks(sink)
        frames = e["frames"]
        assert [(f["line"], f["name"], f["cell"]) for f in frames] == \
            [(6, "<module>", True), (4, "wait", True)]
        assert frames[-1]["call"] == "time.sleep(0.01)" and frames[0]["code"] == "wait(flag)"
        assert e["reason"] == "stall" and e["collective"] is None and e["idle_s"] >= 0.1
        watch._next = 0.0  # the next sample is due at once: the same place is not sent again
        watch.tick()
        assert len(stacks(sink)) == 1
        watch.progress()  # progress: nothing is sampled until it stalls again
        watch._next = 0.0
        watch.tick()
        assert len(stacks(sink)) == 1
        cell.stop.set()
    assert watch.thread is None and sink.events[-1]["kind"] == STACK


def test_the_collective_the_cell_is_in_and_its_count_go_with_the_stack():
    sink, watch = Sink(), Watch()
    with CellThread(watch, sink, enter=True):
        watch.capture_interrupt()
        watch.capture_interrupt()  # once per cell: the first report is the one before unwinding
    [e] = stacks(sink)
    assert e["reason"] == "interrupt"
    assert e["collective"]["op"] == "all_reduce" and e["collective"]["seq"] == 1
    assert e["collective"]["bytes"] == 16 and e["calls"] == {"all_reduce": 1}
    watch.leave()
    assert watch.op is None


def test_a_second_caller_returns_only_once_the_first_callers_report_is_in_the_sink(
        monkeypatch):
    """The watcher thread and the cell's SIGINT handler both report one interrupt: the
    handler (second) must not let the interrupt land before the watcher's report is sent,
    or the report would follow the cell's end and miss its last batch."""
    sink, watch = Sink(), Watch()
    entered, release = threading.Event(), threading.Event()
    sample = watch._sample

    def slow(*args, **kw):  # the first caller reads stacks and the Flight Recorder
        entered.set()
        release.wait(5)
        sample(*args, **kw)

    monkeypatch.setattr(watch, "_sample", slow)
    with CellThread(watch, sink, enter=True):
        first = threading.Thread(target=watch.capture_interrupt)
        first.start()
        assert entered.wait(5)
        second = threading.Thread(target=watch.capture_interrupt)
        second.start()
        second.join(0.3)
        assert second.is_alive() and stacks(sink) == []  # waits for the first's report
        release.set()
        second.join(5)
        assert not second.is_alive() and [e["reason"] for e in stacks(sink)] == ["interrupt"]
        first.join(5)


def test_a_wait_in_a_collective_is_sampled_after_a_second_whatever_the_threshold():
    """With the default threshold (10 s: a first sample after 5 s), a cell inside a collective
    says where it is after a second without progress (a peer that finished never joins it);
    a cell elsewhere still waits for half the threshold."""
    for enter in (True, False):
        sink, watch = Sink(), Watch()
        with CellThread(watch, sink, stall_after=None, enter=enter):
            watch.last_progress -= stall_probe.COLLECTIVE_PROBE_S - 0.2
            watch.tick()
            assert stacks(sink) == []  # under a second
            watch.last_progress -= 0.3
            watch.tick()
            assert len(stacks(sink)) == (1 if enter else 0), enter
            if enter:
                assert stacks(sink)[0]["collective"]["op"] == "all_reduce"


def test_with_long_steps_a_wait_in_a_collective_is_news_after_two_median_steps():
    sink, watch = Sink(), Watch()
    with CellThread(watch, sink, stall_after=None, enter=True):
        for _ in range(3):
            watch.step(1.5)  # the threshold stays 10 s; two median steps are 3 s
        watch.last_progress = time.monotonic() - 2.5
        watch.tick()
        assert stacks(sink) == []  # a long step may wait this long
        watch.last_progress -= 0.7
        watch.tick()
        assert len(stacks(sink)) == 1


def test_sampling_is_off_with_stall_after_zero_but_interrupts_are_still_reported():
    sink, watch = Sink(), Watch()
    with CellThread(watch, sink, stall_after=0):
        watch.last_progress -= 60  # a minute without progress: the sampler still stays quiet
        watch._next = 0.0
        watch.tick()
        assert stacks(sink) == []
        watch.capture_interrupt()
    assert [e["reason"] for e in stacks(sink)] == ["interrupt"]


def test_a_sampled_or_held_frame_keeps_none_of_the_cells_objects_past_the_cell():
    sink, watch = Sink(), Watch()
    refs = []

    class Batch:
        pass

    def cell_body() -> None:
        batch = Batch()  # what the cell's frame holds while it is sampled
        refs.append(weakref.ref(batch))
        here = sys._getframe()
        watch.capture_interrupt(here)  # sampled, as the SIGINT handler samples the cell
        watch.hold(here)  # and held, as the debugger holds the frame it stopped at
        del here

    collecting = gc.isenabled()
    gc.disable()  # freed by reference counting alone, as the cell's own objects are
    try:
        watch.begin(sink, CELL, True, 0.2)
        cell_body()
        assert refs[0]() is not None  # the debugger's frame is held until the cell ends
        watch.end()
        assert refs[0]() is None
    finally:
        if collecting:
            gc.enable()
    [e] = stacks(sink)
    assert e["reason"] == "interrupt" and e["frames"][-1]["name"].endswith("cell_body")


def test_call_text_is_the_call_expression_in_progress():
    if sys.version_info < (3, 11):
        pytest.skip("instruction positions arrived in Python 3.11")
    source = ("import sys\n"
              "def where_am_i(*args):\n"
              "    return call_text(sys._getframe(1))  # the caller, inside its call\n"
              "x = where_am_i(1,\n"
              "               2)\n")
    ns = {"call_text": call_text}
    run_code(source, "<c>", ns)
    assert ns["x"] == "where_am_i(1, 2)"


def test_stack_frames_drop_the_samplers_own_frames_and_keep_the_innermost():
    grabbed: list = []
    interrupt.set_hook(lambda frame: grabbed.append(sys._getframe(1)))  # interrupt.py's frame
    try:
        interrupt._before_interrupt()
    finally:
        interrupt.set_hook(None)
    assert grabbed[0].f_code.co_filename == interrupt.__file__
    frames = stack_frames(grabbed[0], "<not a cell>")
    assert [f["cell"] for f in frames] == [False]  # no cell frame here, only the innermost
    assert frames[0]["name"] == (f"{__name__}.test_stack_frames_drop_the_samplers_own_"
                                 "frames_and_keep_the_innermost")


def test_sigint_tells_the_hook_where_the_cell_was_before_it_unwinds():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    seen: list = []
    # An engine's own handler raises KeyboardInterrupt, whatever an earlier test installed.
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    before = signal.getsignal(signal.SIGINT)
    interrupt.set_hook(lambda frame: seen.append(frame))
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupt.interruptible(lambda: None):
                signal.raise_signal(signal.SIGINT)
                time.sleep(5)  # not reached: the interrupt lands first
    finally:
        interrupt.set_hook(None)
        after = signal.signal(signal.SIGINT, outer)
    assert after is before  # the engine's handler is back
    here = sys._getframe().f_code
    assert any(f is not None and f.f_code is here for f in seen)  # the frame that was running


def test_an_interrupt_by_thread_tells_the_hook_first():
    seen: list = []
    started = threading.Event()

    def busy() -> None:
        ident = interrupt.register_call("tag")
        started.set()
        try:
            while True:
                time.sleep(0.01)
        except KeyboardInterrupt:
            seen.append("interrupted")
        finally:
            interrupt.forget_call(ident)

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    started.wait(5)
    interrupt.set_hook(lambda frame: seen.append("hook"))
    try:
        assert interrupt.interrupt_calls("tag") == 1
        t.join(5)
    finally:
        interrupt.set_hook(None)
    assert seen[:1] == ["hook"] and "interrupted" in seen


# ----------------------------------------------------------------- the Flight Recorder
def _fr_entry(seq: int, retired: bool, t_ns: int, op: str = "gloo:all_reduce") -> dict:
    """An entry as torch 2.13's ``_dump_fr_trace`` pickles it for a gloo group."""
    return {"record_id": seq, "pg_id": 0, "process_group": ("0", "default_pg"),
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": op,
            "time_created_ns": t_ns, "input_sizes": [[1000]], "input_dtypes": ["Float"],
            "output_sizes": [[1000]], "output_dtypes": ["Float"], "state": "scheduled",
            "retired": retired, "timeout_ms": 1800000, "is_p2p": False}


def test_flight_recorder_entries_of_this_cell_the_open_ones_and_the_last_done(monkeypatch):
    entries = [_fr_entry(1, True, 100)] + [_fr_entry(s, True, 1000 + s) for s in range(2, 8)]
    entries.append(_fr_entry(8, False, 2000))
    dumped = pickle.dumps({"version": "2.10", "entries": entries})
    fake = types.ModuleType("torch._C._distributed_c10d")
    fake._dump_fr_trace = lambda **kw: dumped
    monkeypatch.setitem(sys.modules, "torch._C._distributed_c10d", fake)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    out = flight_recorder(since_ns=500)  # entry 1 belongs to an earlier cell
    assert [(e["seq"], e["done"]) for e in out] == [(5, True), (6, True), (7, True), (8, False)]
    assert out[-1] == {"group": "default_pg", "op": "all_reduce", "seq": 8, "sizes": [[1000]],
                       "dtypes": ["Float"], "state": "scheduled", "done": False, "p2p": False}
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    assert flight_recorder() is None  # recording nothing: nbdist's own count is used instead
    monkeypatch.delitem(sys.modules, "torch._C._distributed_c10d")
    assert flight_recorder() is None


def test_nccl_groups_are_read_from_nccls_own_recorder_and_no_entry_counts_twice(monkeypatch):
    """A CUDA build keeps NCCL's entries apart (``_dump_nccl_trace``): a GPU job's hang is
    read there, beside gloo's recorder; an entry both dumps hold is one entry."""
    gloo = [_fr_entry(1, True, 1001)]
    nccl = [_fr_entry(1, True, 1001), _fr_entry(2, False, 1002, op="nccl:all_reduce")]
    nccl[1]["process_group"] = ("1", "default_pg")
    fake = types.ModuleType("torch._C._distributed_c10d")
    fake._dump_fr_trace = lambda **kw: pickle.dumps({"entries": gloo})
    fake._dump_nccl_trace = lambda **kw: pickle.dumps({"entries": nccl})
    monkeypatch.setitem(sys.modules, "torch._C._distributed_c10d", fake)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    out = flight_recorder()
    assert [(e["op"], e["seq"], e["done"]) for e in out] == [("all_reduce", 1, True),
                                                             ("all_reduce", 2, False)]

    def broken(**kw):
        raise RuntimeError("no NCCL group")

    fake._dump_nccl_trace = broken  # one dump failing leaves the other's entries
    assert [e["seq"] for e in flight_recorder()] == [1]
    fake._dump_fr_trace = broken
    assert flight_recorder() is None


def test_the_flight_recorder_is_enabled_unless_the_user_chose_a_size(monkeypatch):
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    stall_probe.enable_flight_recorder()
    import os

    assert os.environ["TORCH_FR_BUFFER_SIZE"] == str(stall_probe.FLIGHT_RECORDER_ENTRIES)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    stall_probe.enable_flight_recorder()
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "0"
