"""What elastic training went through, in words and marks (:mod:`nbdist.telemetry.recovery`):
a lost rank, a recovery's line, and where a replacement's steps begin. (The same records in a
run's fold and views: ``test_run_recovery.py``.)"""

from __future__ import annotations

import time

from nbdist.telemetry.recovery import Incarnations, Lost, Mark, Recovery, RecoveryKind

T = 1_700_000_000.0
CLOCK = time.strftime("%H:%M:%S", time.localtime(T))


def test_a_lost_rank_says_where_it_was_and_why_as_far_as_it_is_known():
    lost = Lost(T, 1, "hostB", 41, "SIGKILL")
    assert str(lost) == "rank 1 on hostB (pid 41) died: SIGKILL"
    assert lost.line() == f"nbdist.elastic {CLOCK}: rank 1 on hostB (pid 41) died: SIGKILL"
    assert (lost.reason, lost.gone()) == ("SIGKILL", "its worker (pid 41) died: SIGKILL")
    unknown = Lost(T, None, by="nbdist")
    assert str(unknown) == "rank ? on ? died" and unknown.line().startswith("nbdist ")
    assert (unknown.reason, unknown.gone()) == ("its worker is gone", "its worker is gone")


def test_a_recovery_says_who_was_lost_how_far_it_went_back_and_how_long_it_took():
    failure = Recovery(T, RecoveryKind.FAILURE, [Lost(T, 1), Lost(T, 3)], 4, 2, commit=6,
                       discarded=1, seconds=0.25)
    assert failure.line() == (f"nbdist.elastic {CLOCK}: the group re-formed without ranks 1, 3; "
                              "rolled back to commit 6 (1 optimizer step repeated), healed in "
                              "250 ms; world 4 -> 2")
    assert Recovery(T, RecoveryKind.FAILURE, world_before=2, world_after=1).line() == (
        f"nbdist.elastic {CLOCK}: a collective failed; re-forming; world 2 -> 1")
    joined = Recovery(T, RecoveryKind.JOINED, world_before=1, world_after=2, commit=20)
    assert joined.line().endswith("a replacement worker joined at commit 20, healed from a "
                                  "live peer; world 1 -> 2")
    stopped = Recovery(T, RecoveryKind.STOPPED, why="max_failures (1) reached")
    assert stopped.line() == f"nbdist.elastic {CLOCK}: stopped: max_failures (1) reached"


def test_a_replacement_starts_at_the_step_its_record_names_else_after_the_latest():
    inc = Incarnations()
    assert inc.joined(Recovery(T, RecoveryKind.JOINED, rank=1, step=20), fallback=7) == 20
    assert inc.joined(Recovery(T, RecoveryKind.JOINED, rank=2), fallback=7) == 7
    assert inc.joined(Recovery(T, RecoveryKind.FAILURE, rank=1), fallback=9) is None
    assert inc.joined(Recovery(T, RecoveryKind.JOINED), fallback=9) is None  # no rank named
    assert inc.offset == {1: 20, 2: 7}


def test_each_record_becomes_a_mark_at_its_step_with_its_label_and_colour():
    inc = Incarnations()
    inc.record(Lost(T, 1, cause="SIGKILL"), died_at=5, joined_at=None)
    inc.record(Recovery(T, RecoveryKind.FAILURE, [Lost(T, 1)]), died_at=5, joined_at=None)
    inc.record(Recovery(T, RecoveryKind.JOINED, rank=1), died_at=None, joined_at=12)
    inc.record(Recovery(T, RecoveryKind.STOPPED, why="x"), died_at=30, joined_at=None)
    assert [(m.kind, m.step, m.label, m.failure) for m in inc.marks] == [
        ("died", 5, "rank 1 died", True), ("re-formed", 5, "re-formed", False),
        ("joined", 12, "replacement joined", False), ("stopped", 30, "stopped", True)]
    assert inc.marks[0].text.endswith("rank 1 on ? died: SIGKILL")
    assert Mark(T, "died", "").label == "a rank died"


def test_a_lost_rank_names_the_cell_line_and_its_last_lines_on_stderr():
    gloo = "  what():  Received data size doesn't match expected size."
    lost = Lost(T, 0, "h1", 41, "SIGABRT", "nbdist", cell_line="line 2 of In [5]",
                tail=("terminate called after throwing an instance of 'gloo::EnforceNotMet'",
                      gloo))
    # the same words in the row, the header and the error
    assert lost.reason == "SIGABRT at line 2 of In [5]"
    assert str(lost) == "rank 0 on h1 (pid 41) died: SIGABRT at line 2 of In [5]"
    assert lost.gone() == "its worker (pid 41) died: SIGABRT at line 2 of In [5]"
    assert lost.said().splitlines() == [
        "its last lines on stderr:",
        "    terminate called after throwing an instance of 'gloo::EnforceNotMet'",
        f"    {gloo}"]
    # where nothing said the line (SIGKILL): the signal only, as before
    killed = Lost(T, 1, "h1", 42, "SIGKILL", "nbdist")
    assert (killed.reason, killed.gone(), killed.said()) == (
        "SIGKILL", "its worker (pid 42) died: SIGKILL", "")
    far = Lost(T, 1, "h2", 43, "SIGKILL", "nbdist", kept_at="h2:/tmp/nbdist-0/rank-43.err")
    assert far.said() == "its stderr is kept in h2:/tmp/nbdist-0/rank-43.err\n"
