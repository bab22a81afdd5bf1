"""Ranks that finished the cell while others wait in a collective they will never call: when
the hang doctor is certain of it (:meth:`StallWatch.stranded`), from synthetic reports with an
explicit clock, and what the error says."""

from __future__ import annotations

from synthetic import CELL_FILE, T0, stack_sleeping, stack_waiting

from nbdist.errors import RanksFinishedError
from nbdist.telemetry import events as ev
from nbdist.telemetry.aggregate import RunState
from nbdist.telemetry.stall.report import FINISHED, STRANDED_AFTER_S
from nbdist.telemetry.stall.words import where_lines

AFTER = STRANDED_AFTER_S


def feed(state: RunState, rank: int, *events: dict, seq: int = 1) -> None:
    state.feed([{"rank": rank, "seq": seq, "events": list(events)}])


def stack_in_backward(t: float, seq: int = 13) -> dict:
    """A rank in a DDP model's backward, waiting for the gradients' all-reduce ``seq`` (only
    the Flight Recorder knows it: DDP's reducer calls no Python collective)."""
    frames = [{"file": CELL_FILE, "line": 10, "name": "<module>", "cell": True,
               "code": "loss.backward()", "call": "loss.backward()"},
              {"file": "/x/torch/autograd/graph.py", "line": 829, "cell": False,
               "name": "torch.autograd.graph._engine_run_backward", "code": "", "call": None}]
    fr = [{"group": "0", "op": "all_reduce", "seq": seq, "sizes": [[5]], "dtypes": ["Float"],
           "state": "scheduled", "done": False, "p2p": False}]
    return ev.stack(t, "stall", 1.0, frames, flight=fr, calls={})


def uneven(stack: dict, *, ok: bool = True, stall_after=None) -> RunState:
    """Rank 1 ended its cell at T0 + 1; rank 0 then reports ``stack``."""
    state = RunState([0, 1], started=T0, stall_after=stall_after)
    feed(state, 1, ev.end(ok, T0 + 1, None if ok else "ValueError: x"))
    feed(state, 0, stack)
    return state


def test_a_collective_of_every_rank_with_a_finished_peer_is_stranded_after_the_grace():
    state = uneven(stack_waiting(T0 + 1.5))
    assert state.stranded(T0 + 1 + AFTER - 0.1) is None  # not yet certain
    s = state.stranded(T0 + 1 + AFTER)
    assert s is not None and s.finished == (1,) and not s.ddp
    [w] = s.waiting
    assert (w.rank, w.collective.op, w.collective.seq, w.line) == (0, "all_reduce", 5, 6)
    # the finished rank reads finished, not "no report of where it is"
    assert s.report.rank(1).status == FINISHED
    assert where_lines(s.report)[1] == ("rank 1: finished the cell; it never reached the "
                                        "all_reduce the others wait in")


def test_a_wait_in_a_ddp_backward_is_named_as_ddps_and_the_error_gives_join():
    state = uneven(stack_in_backward(T0 + 2))
    s = state.stranded(T0 + 5)
    assert s is not None and s.ddp and s.finished == (1,)
    text = str(RanksFinishedError(s, [0], s.report, "In [3]"))
    assert text.startswith(
        "cell ended: Rank 1 finished the cell while rank 0 waits in all_reduce (seq 13, "
        "float32 [5]) at In [3], line 10: loss.backward(): a collective of every rank, which "
        "rank 1 will never call. Rank(s) [0] were interrupted now rather than at the group's "
        "timeout."), text
    assert "`with model.join():` (torch.distributed.algorithms.Join)" in text
    assert "rank 1: finished the cell" in text and "no report of where" not in text


def test_a_collective_outside_ddp_is_named_plainly_without_ddp_advice():
    s = uneven(stack_waiting(T0 + 2)).stranded(T0 + 5)
    assert s is not None and not s.ddp
    text = str(RanksFinishedError(s, [0], s.report))
    assert "join()" not in text and "DistributedDataParallel step" not in text
    assert "The ranks called different numbers of collectives" in text


def test_a_peer_that_still_computes_is_not_stranded():
    """Rank 1 finished while rank 0 is elsewhere in the cell: it may still reach any
    collective, and the cell goes on."""
    state = uneven(stack_sleeping(T0 + 2))
    assert state.stranded(T0 + 60) is None


def test_a_peer_with_no_report_yet_is_not_stranded():
    state = RunState([0, 1], started=T0)
    feed(state, 1, ev.end(True, T0 + 1))
    assert state.stranded(T0 + 60) is None


def test_progress_after_the_report_means_the_collective_completed():
    state = uneven(stack_waiting(T0 + 2))
    feed(state, 0, ev.step(4, T0 + 2.5, T0 + 3), seq=2)
    assert state.stranded(T0 + 60) is None


def test_sends_receives_and_collectives_of_other_groups_may_complete_without_the_finished():
    for entry in ({"group": "3", "p2p": False}, {"group": "0", "p2p": True}):
        stack = stack_waiting(T0 + 2)
        stack["flight"][-1].update(entry)
        assert uneven(stack).stranded(T0 + 60) is None, entry


def test_a_failed_peer_is_not_a_finished_one():
    """A rank that failed severs its side of the group itself: its peers' collective fails."""
    assert uneven(stack_waiting(T0 + 2), ok=False).stranded(T0 + 60) is None


def test_the_hang_doctor_off_leaves_it_to_the_timeout():
    assert uneven(stack_waiting(T0 + 2), stall_after=0).stranded(T0 + 60) is None


def test_a_rank_in_the_debugger_is_the_users_not_stranded():
    state = uneven(stack_waiting(T0 + 2))
    feed(state, 0, ev.debugger("enter", T0 + 2.5, file=CELL_FILE, line=4), seq=2)
    assert state.stranded(T0 + 60) is None
