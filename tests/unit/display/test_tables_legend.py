"""The dashboard explains itself: each header figure says whether it is one rank's or the
job's, a column has one unit, the memory table says what it shows, a rank has one colour in
the tables and the charts."""

from __future__ import annotations

import re
from dataclasses import replace

from synthetic import aggregate_job

from nbdist.display import html as H
from nbdist.display.tables import (
    MEMORY_CAPTION,
    MEMORY_HEADER,
    diagnosis_phrases,
    memory_table,
    progress_phrases,
    run_table,
)
from nbdist.display.text import format_summary
from nbdist.table_layout import RANK_COLOURS, html_table, rank_colour
from nbdist.telemetry.snapshot import MemoryPoint


def test_header_figures_say_per_rank_or_all_ranks():
    snap = aggregate_job({0: 0.010, 1: 0.015})
    pace = progress_phrases(snap)
    assert "58.8 steps/s per rank" in pace  # the slowest rank's pace
    assert "941 samples/s all ranks" in pace  # the sum over ranks
    assert "bandwidth 500 kB/s per rank" in diagnosis_phrases(snap)


def with_memory(snap, held):
    ranks = tuple(replace(r, memory=MemoryPoint(params=p, grads=p, optimizer=0, rss=370e6,
                                                  peak=369e6))
                  for r, p in zip(snap.ranks, held))
    return replace(snap, ranks=ranks)


def test_the_memory_table_is_captioned_and_in_one_unit_per_column():
    snap = with_memory(aggregate_job({0: 0.010, 1: 0.015}), (19_000, 2_000_000))
    table = memory_table(snap)
    params = [r.cells[MEMORY_HEADER.index("params")] for r in table.rows]
    assert params == ["0.02 MB", "2 MB"]
    assert "<caption" in H.detail_tables(snap) and MEMORY_CAPTION in H.detail_tables(snap)
    text = format_summary(snap)
    assert f"\n{MEMORY_CAPTION}\nrank  params" in text, text


def test_a_rank_has_one_colour_in_the_table_and_the_charts():
    snap = aggregate_job({0: 0.010, 1: 0.015, 2: 0.012})
    markup = html_table(run_table(snap))
    for rank in (0, 1, 2):
        row = re.search(rf"<tr class='[^']*nbdist-rank-{rank}\b.*?</tr>", markup).group(0)
        assert f"background:{rank_colour(rank)}'></span>" in row
    # a chart of ranks 2 and 5 draws rank 2 in rank 2's colour, not the first colour
    svg = H.scalar_chart_svg("loss", {2: ((0.0, 1.0), (1.0, 0.5)), 5: ((0.0, 2.0), (1.0, 0.7))})
    assert f"stroke='{rank_colour(2)}'" in svg and f"stroke='{rank_colour(5)}'" in svg
    assert f"fill='{rank_colour(2)}'>rank 2<" in svg
    assert rank_colour(2) != RANK_COLOURS[0] and rank_colour(len(RANK_COLOURS)) == RANK_COLOURS[0]
