"""The hang doctor's verdict in words (:mod:`nbdist.telemetry.stall.words`), on reports
judged from hand-made positions: the headline, a line per rank, the sentences of an error."""

from __future__ import annotations

from nbdist.telemetry.stall.report import (
    ELSEWHERE,
    FAILED,
    FINISHED,
    IN_COLLECTIVE,
    UNKNOWN,
    Collective,
    Frame,
    RankWhere,
    judge,
)
from nbdist.telemetry.stall.words import (
    clash_sentences,
    headline,
    missing_sentence,
    rank_line,
    where_lines,
)

ALL_REDUCE = Collective("all_reduce", 5, "default_pg", "float32 [4]")


def waiting(rank: int, c: Collective = ALL_REDUCE) -> RankWhere:
    return RankWhere(rank, IN_COLLECTIVE, c, line=6, code="dist.all_reduce(t)")


def sleeping(rank: int) -> RankWhere:
    """In ``time.sleep(1)``, called at line 5 of the cell (its innermost frame)."""
    return RankWhere(rank, ELSEWHERE, doing="time.sleep(1)", line=5, code="time.sleep(1)",
                     frames=(Frame("<cell>", 5, "<module>", True, "time.sleep(1)",
                                   "time.sleep(1)"),))


def test_the_headline_says_how_long_who_waits_in_what_and_who_never_came():
    v = judge([waiting(0), waiting(2), sleeping(1)], idle_s=12.0, threshold_s=10.0)
    assert headline(v) == ("no step or collective completed for 12 s (stall threshold 10 s): "
                           "ranks 0, 2 wait in all_reduce (seq 5, float32 [4]); "
                           "rank 1 never reached it")
    assert missing_sentence(v) == (
        "Rank 1 never reached the all_reduce (seq 5, float32 [4]) that ranks 0, 2 wait in.")


def test_without_a_collective_there_is_no_one_to_blame():
    v = judge([sleeping(0), sleeping(1)], idle_s=30.0)
    assert headline(v) == ("no step or collective completed for 30 s: "
                           "no rank is inside a collective")
    assert missing_sentence(v) == "" and clash_sentences(v) == []


def test_a_line_per_rank_says_where_it_is_or_how_it_ended():
    assert rank_line(waiting(0), "In [7]") == (
        "rank 0: waiting in all_reduce (seq 5, float32 [4]) at In [7], line 6: "
        "dist.all_reduce(t)")
    assert rank_line(sleeping(1)) == "rank 1: in time.sleep(1) at cell line 5"  # said once
    in_a_library = RankWhere(1, ELSEWHERE, doing="socket.recv", line=5, code="fetch()")
    assert rank_line(in_a_library) == "rank 1: in socket.recv at cell line 5: fetch()"
    assert rank_line(RankWhere(2, FINISHED)) == "rank 2: finished the cell"
    assert rank_line(RankWhere(3, FAILED, error="ValueError:\n  bad   value")) == (
        "rank 3: failed: ValueError: bad value")  # an error's lines become one
    assert rank_line(RankWhere(4, UNKNOWN)) == "rank 4: no report of where it is"
    assert rank_line(RankWhere(2, FINISHED), missing=[2], waits=[ALL_REDUCE]) == (
        "rank 2: finished the cell; it never reached the all_reduce the others wait in")


def test_ranks_that_say_the_same_are_one_line_above_the_grouping_size():
    v = judge([waiting(r) for r in range(5)] + [sleeping(5)], idle_s=11.0)
    grouped = where_lines(v, group_above=4)
    assert grouped[0].startswith("ranks 0-4: waiting in all_reduce")
    assert grouped[1].startswith("rank 5: in time.sleep(1)") and len(grouped) == 2
    assert len(where_lines(v, group_above=6)) == 6  # few ranks: one line each


def test_different_collectives_in_the_same_place_are_a_clash():
    broadcast = Collective("broadcast", 5, "default_pg", "float32 [4]")
    v = judge([waiting(0), waiting(1, broadcast)], idle_s=11.0)
    assert clash_sentences(v) == [
        "all_reduce and broadcast are both collective 5 of group default_pg: the ranks called "
        "different collectives."]
    assert headline(v).endswith("the ranks called different collectives")
