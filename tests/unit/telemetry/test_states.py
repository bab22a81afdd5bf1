"""The states a rank goes through in a run (:class:`nbdist.telemetry.states.RankState`)."""

from __future__ import annotations

from nbdist.telemetry.states import RankState


def test_a_state_is_its_word():
    assert RankState.DONE == "done" and str(RankState.DIED) == "died"
    assert f"{RankState.FAILED}" == "failed"
    assert RankState("stopped") is RankState.STOPPED


def test_each_state_is_either_active_broken_or_done():
    active = {s for s in RankState if s.active}
    broken = {s for s in RankState if s.broken}
    assert active == {RankState.WAITING, RankState.RUNNING}
    assert broken == {RankState.FAILED, RankState.STOPPED, RankState.DIED}
    assert set(RankState) - active - broken == {RankState.DONE}
