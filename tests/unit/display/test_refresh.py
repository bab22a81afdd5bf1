"""The rate limit every live view shares (:class:`nbdist.display.refresh.Throttle`)."""

from __future__ import annotations

from nbdist.display.refresh import Throttle


def test_throttle_limits_redraws():
    now = [0.0]
    t = Throttle(0.25, clock=lambda: now[0])
    assert t.due() and not t.due()
    now[0] = 0.2
    assert not t.due()
    now[0] = 0.26
    assert t.due()


def test_the_interval_counts_from_the_last_redraw_not_the_last_question():
    now = [0.0]
    t = Throttle(1.0, clock=lambda: now[0])
    assert t.due()
    asked = []
    for tick in range(1, 31):  # asked every 0.1 s for 3 s
        now[0] = tick / 10
        asked.append(t.due())
    assert [i for i, yes in enumerate(asked, 1) if yes] == [10, 20, 30]
    t.interval = 0.0  # a view may change its interval; 0 draws on every question
    assert t.due() and t.due()
