"""Workers' output as HTML (:mod:`nbdist.display.output_html`): escaped, stderr marked, each
block of a height that scrolls; the static per-rank view a saved notebook keeps."""

from __future__ import annotations

from nbdist.display.output_html import (
    OUTPUT_MAX_HEIGHT,
    output_pre,
    rank_output_html,
    warnings_html,
)
from nbdist.display.rank_output import RankLines, merged_lines


def test_output_boxes_cap_their_height_and_mark_stderr():
    lines = RankLines()
    lines.feed(0, "stdout", "step 1\n")
    lines.feed(0, "stderr", "checkpoint <1>\n")
    html = output_pre(merged_lines(lines))
    assert f"max-height:{OUTPUT_MAX_HEIGHT};overflow-y:auto" in html
    assert "<span class='nbdist-stderr'" in html and "[0] checkpoint &lt;1&gt;</span>" in html
    assert "[0] step 1\n" in html and "step 1</span>" not in html


def test_a_saved_notebook_keeps_the_merged_lines_and_a_block_per_rank():
    html = rank_output_html([("stdout", "[0] a"), ("stdout", "[1] b")],
                            [(0, [("stdout", "a")]), (1, [("stderr", "b & c")])])
    assert html.count("<pre class='nbdist-output'") == 3  # merged, then one per rank
    assert html.index("[0] a") < html.index("<details class='nbdist-rank-output-0'>")
    assert "<summary>rank 1</summary>" in html and "b &amp; c</span>" in html


def test_warnings_are_escaped_one_per_line():
    html = warnings_html(["ranks 0-1: UserWarning: <x>", "rank 2: DeprecationWarning: y"])
    assert "ranks 0-1: UserWarning: &lt;x&gt;\nrank 2: DeprecationWarning: y</pre>" in html
    assert html.startswith("<pre class='nbdist-warnings'")
