"""A training step's record and the events it becomes (:mod:`nbdist.runtime.measure.steps`):
DDP's own timer or each bucket's span, the communication compute did not hide, a step that
synced untimed, and CUDA buckets read once their events completed."""

from __future__ import annotations

import pytest

from nbdist.runtime.measure.steps import Bucket, DDPTimes, Step, resolve_cuda, step_events


def bucket(index, ready, issued=None, done=None, nbytes=100, op="all_reduce"):
    b = Bucket(index, ready)
    b.issued, b.done, b.nbytes, b.op, b.dtype = issued, done, nbytes, op, "float32"
    return b


def test_ddps_own_timer_is_one_all_reduce_and_its_part_after_compute_is_exposed():
    st = Step(3, 10.0, "ddp")
    st.fwd0, st.fwd1, st.samples = 10.0, 10.2, 32
    times = DDPTimes(compute_end=10.6, comm_start=10.4, comm_end=10.9, nbytes=4000, buckets=2,
                     dtype="float32")
    comm, step = step_events(st, 11.0, final=False, ddp=times)
    assert (comm["op"], comm["measured"], comm["bytes"], comm["step"]) == (
        "all_reduce", "ddp", 4000, 3)
    assert step["comm_total_s"] == pytest.approx(0.5)
    assert step["comm_exposed_s"] == pytest.approx(0.3)  # 10.6 -> 10.9: after the last bucket
    assert (step["buckets"], step["comm_bytes"], step["samples"]) == (2, 4000, 32)
    assert step["fwd"] == [10.0, 10.2] and step["bwd"] == [10.2, 10.9]
    assert step["t1"] == 11.0 and step["comm_timed"]


def test_buckets_timed_by_the_hook_each_become_a_collective_and_local_ones_send_nothing():
    st = Step(0, 0.0, "ddp")
    st.buckets = [bucket(0, 0.5, 0.5, 0.8), bucket(1, 0.7, 0.75, 1.0),
                  bucket(2, 0.9, op="local"), bucket(3, 0.6, done=None, nbytes=7)]
    *comms, step = step_events(st, 1.2, final=False, ddp=None)
    assert [(c["bucket"], c["measured"]) for c in comms] == [(0, "wire"), (1, "wire"),
                                                             (3, "untimed")]
    assert comms[2]["t0"] == comms[2]["t1"] == 0.6
    assert step["comm_bytes"] == 207 and step["buckets"] == 4
    assert step["comm_total_s"] == pytest.approx(0.3 + 0.25)
    assert step["comm_exposed_s"] == pytest.approx(0.1)  # last ready 0.9; union ends at 1.0


def test_a_step_that_synced_untimed_counts_its_bytes_but_not_its_times():
    class Timer:  # DDP timed another iteration, not this one
        iterations, nbytes, buckets = 4, 4096, 3

    st = Step(1, 5.0, "ddp")
    st.timer = Timer()
    [step] = step_events(st, 5.5, final=False, ddp=None)
    assert (step["comm_timed"], step["comm_bytes"], step["buckets"]) == (False, 4096, 3)
    assert step["comm_total_s"] == 0.0 and step["comm_exposed_s"] == 0.0


def test_the_cells_last_step_ends_with_its_communication():
    st = Step(7, 1.0, "optim")
    st.buckets = [bucket(0, 1.5, 1.5, 2.5)]
    *_, step = step_events(st, 2.0, final=True, ddp=None)
    assert step["t1"] == 2.5 and step["source"] == "optim"
    *_, open_step = step_events(st, 2.0, final=False, ddp=None)
    assert open_step["t1"] == 2.0


def test_a_cuda_bucket_is_read_only_once_both_its_events_completed():
    class Event:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

        def elapsed_time(self, other):
            return 250.0  # milliseconds, as torch.cuda.Event says

    b = Bucket(0, ready=3.0)
    b.cuda = (Event(True), Event(False))
    resolve_cuda(b)
    assert b.done is None  # the all-reduce still runs: nothing waits for it
    b.cuda[1].done = True
    resolve_cuda(b)
    assert b.done == pytest.approx(3.25)
