"""``--all-output`` as a widget: an "all ranks" tab with identical lines folded, a tab per rank.

Switching tabs happens in the browser alone (a Tab's selected index needs no kernel), so it works
while the cell is still running. Built once; each redraw sets only the texts that changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ipywidgets import HTML, Tab

from .output_html import OutputLine, output_pre


class RankOutputTabs(Tab):
    """Every rank's output: tab 0 merged (``[0-1] epoch 1 done``), then one tab per rank."""

    def __init__(self, ranks: Sequence[int]):
        self.ranks = list(ranks)
        self.merged = HTML(output_pre())
        self.per_rank = {r: HTML(output_pre()) for r in self.ranks}
        super().__init__([self.merged, *self.per_rank.values()])
        self.titles = ("all ranks", *(f"rank {r}" for r in self.ranks))
        self.add_class("nbdist-rank-output")
        self.merged.add_class("nbdist-output-merged")
        for r, view in self.per_rank.items():
            view.add_class(f"nbdist-output-rank-{r}")

    def show(self, merged: Sequence[OutputLine],
             per_rank: Mapping[int, Sequence[OutputLine]]) -> None:
        """Set the merged tab's lines and the lines of the ranks in ``per_rank`` (stderr
        lines marked)."""
        for r, lines in sorted(per_rank.items()):
            if r not in self.per_rank:  # a rank outside the expected set printed
                self.ranks.append(r)
                self.per_rank[r] = view = HTML("")
                view.add_class(f"nbdist-output-rank-{r}")
                titles = tuple(self.titles)  # a new child resets titles to its length
                self.children = (*self.children, view)
                self.titles = (*titles, f"rank {r}")
            self.per_rank[r].value = output_pre(lines)
        self.merged.value = output_pre(merged)
