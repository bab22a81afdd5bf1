"""Per-rank output in the notebook: lines per rank, the merged view's folding, warnings once."""

from __future__ import annotations

import io

import pytest

from nbdist.display.rank_output import (
    OutputView,
    RankLines,
    WarningLog,
    merged_text,
    rank_label,
    rank_text,
)
from nbdist.telemetry import events as ev


def batch(rank, seq, *events):
    return {"rank": rank, "seq": seq, "events": list(events)}


def test_rank_label_compacts_runs():
    assert rank_label([1, 0]) == "[0-1]"
    assert rank_label([0, 2, 3]) == "[0,2-3]"
    assert rank_label([4]) == "[4]"


def test_identical_lines_fold_and_each_rank_keeps_its_order():
    lines = RankLines()
    lines.feed(0, "stdout", "epoch 0 done\nloss 0.5\n")
    lines.feed(1, "stdout", "epoch 0 done\nloss 0.6\nepoch 1 done\n")
    lines.feed(0, "stdout", "epoch 1 done\n")
    assert merged_text(lines).splitlines() == [
        "[0-1] epoch 0 done", "[0] loss 0.5", "[1] loss 0.6", "[0-1] epoch 1 done"]
    assert rank_text(lines, 1).splitlines() == ["epoch 0 done", "loss 0.6", "epoch 1 done"]


def test_repeated_lines_fold_one_to_one_not_all_into_the_first():
    lines = RankLines()
    for r in (0, 1):
        lines.feed(r, "stdout", "step\n" * 3)
    assert merged_text(lines).splitlines() == ["[0-1] step"] * 3


def test_a_line_never_folds_backwards_past_the_ranks_previous_line():
    lines = RankLines()
    lines.feed(0, "stdout", "done\n")
    lines.feed(1, "stdout", "extra\ndone\n")
    # rank 1's "done" comes after its "extra": it cannot join rank 0's earlier "done"
    assert merged_text(lines).splitlines() == ["[0] done", "[1] extra", "[1] done"]


def test_partial_lines_carriage_returns_and_streams():
    lines = RankLines()
    lines.feed(0, "stdout", "10%\r50%\r100%")
    assert rank_text(lines, 0) == "100%"  # an unfinished line shows as a terminal would
    assert merged_text(lines) == ""  # ... but is merged only once finished
    lines.feed(0, "stderr", "oops\n")
    lines.close()
    assert [(x.stream, x.text) for x in lines.lines(0)] == [("stderr", "oops"),
                                                              ("stdout", "100%")]
    lines.feed(1, "stdout", "a\r\n")  # CRLF is a newline, not an overwrite
    assert rank_text(lines, 1) == "a"


def test_caps_drop_the_oldest_lines_and_say_so():
    lines = RankLines(max_lines=3)
    lines.feed(0, "stdout", "".join(f"l{i}\n" for i in range(5)))
    assert rank_text(lines, 0).splitlines() == ["... 2 earlier lines", "l2", "l3", "l4"]
    assert merged_text(lines).splitlines()[0] == "... 2 earlier lines"
    lines.feed(1, "stdout", "l4\n")
    assert merged_text(lines).splitlines()[-1] == "[0-1] l4"
    assert merged_text(lines, last=1).splitlines() == ["... 4 earlier lines", "[0-1] l4"]


def test_warning_log_keeps_each_warning_once_with_its_ranks():
    log = WarningLog()
    w = ev.warning("UserWarning", "lr is high", "<distributed cell 2>", 3)
    assert log.add(1, w) and log.add(0, w) and not log.add(0, w)
    assert log.add(0, ev.warning("DeprecationWarning", "old", "x.py", 9))
    assert log.text().splitlines() == [
        "[0-1] <distributed cell 2>:3: UserWarning: lr is high",
        "[0] x.py:9: DeprecationWarning: old"]


def test_output_view_without_a_kernel_streams_and_says_each_warning_once():
    out, err = io.StringIO(), io.StringIO()
    view = OutputView("rank0", ranks=[0, 1], stdout=out, stderr=err)
    w = ev.warning("UserWarning", "careful", "<cell>", 1)
    view.feed([batch(0, 1, ev.stream("stdout", "hi\n"), w), batch(1, 1, w)])
    view.feed([batch(1, 2, ev.stream("stdout", "hidden\n"))])
    view.close()
    assert out.getvalue() == "[0] hi\n"
    assert err.getvalue() == "[0-1] <cell>:1: UserWarning: careful\n"
    quiet = io.StringIO()
    q = OutputView("quiet", stdout=quiet, stderr=quiet)
    q.feed([batch(0, 1, w)])
    q.close()
    assert quiet.getvalue() == ""


def test_all_output_as_tabs_per_rank_and_merged():
    pytest.importorskip("ipywidgets")
    out = io.StringIO()
    view = OutputView("all", ranks=[0, 1], per_rank=True, stdout=out, stderr=out)
    view.feed([batch(0, 1, ev.stream("stdout", "epoch 1 done\nonly 0\n")),
               batch(1, 1, ev.stream("stdout", "epoch 1 done\n"))])
    tabs = view._panel
    assert tabs.titles == ("all ranks", "rank 0", "rank 1")
    assert "[0-1] epoch 1 done" in tabs.merged.value and "[0] only 0" in tabs.merged.value
    assert "only 0" not in tabs.per_rank[1].value
    assert "epoch 1 done" in tabs.per_rank[1].value
    view.feed([batch(2, 1, ev.stream("stdout", "<b>late</b>\n"))])  # a rank not expected
    view.close()
    assert tabs.titles[-1] == "rank 2" and "&lt;b&gt;late" in tabs.per_rank[2].value
    # Without a kernel to display the widget in, the merged text is printed once at the end.
    assert out.getvalue().splitlines() == ["[0-1] epoch 1 done", "[0] only 0", "[2] <b>late</b>"]
