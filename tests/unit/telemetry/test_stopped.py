"""Ranks stopped for the notebook, in the debugger or in ``input()``
(:mod:`nbdist.telemetry.stopped`), as their ``debugger`` events say."""

from __future__ import annotations

from nbdist.telemetry import events as ev
from nbdist.telemetry.stopped import Stopped, Stops


def enter(mode="pdb", line=5, func="<module>", file="<distributed cell 3>"):
    return ev.debugger("enter", 1.0, mode=mode, file=file, line=line, func=func)


def leave(t=2.0):
    return ev.debugger("leave", t)


def test_a_stop_says_where_the_rank_waits():
    assert Stopped(1, "pdb", line=5).describe() == "rank 1 is in the debugger (line 5)"
    assert Stopped(0, "input", line=7, func="ask").describe() == (
        "rank 0 waits for input() (line 7, in ask)")
    assert Stopped(2, "pdb", func="<module>").describe() == "rank 2 is in the debugger"
    assert (Stopped(1, "pdb").doing, Stopped(1, "input").doing) == ("the debugger", "input()")


def test_an_input_inside_the_debugger_stops_a_rank_twice_and_leaving_goes_back_out():
    s = Stops()
    assert not s and s.now() == ()
    assert s.feed(1, enter("pdb", line=5)) is None
    assert s.feed(1, enter("input", line=9)) is None
    assert s.of(1) == Stopped(1, "input", "<distributed cell 3>", 9, "<module>")
    assert s.feed(1, leave(t=4.5)) == 4.5  # the time it went on
    assert s.of(1).mode == "pdb" and bool(s)
    s.feed(1, leave())
    assert s.of(1) is None and not s


def test_now_gives_each_stopped_rank_once_by_rank_and_an_ended_rank_waits_no_more():
    s = Stops()
    s.feed(3, enter(line=1))
    s.feed(0, enter(line=2))
    s.feed(0, enter("input", line=3))
    assert [(x.rank, x.line) for x in s.now()] == [(0, 3), (3, 1)]
    s.end(0)
    assert [x.rank for x in s.now()] == [3]
    assert s.feed(2, leave()) == 2.0 and s.of(2) is None  # a leave without an enter: harmless
