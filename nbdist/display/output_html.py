"""Workers' output as HTML: the lines of each rank, merged or one block per rank, and the
warnings the ranks raised; stderr marked, each block of a height that scrolls."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from ..table_layout import WARNED, WARNED_BACKGROUND

#: ``(stream, text)``: one line of a rank's output, ``stream`` ``"stdout"`` or ``"stderr"``
OutputLine = tuple[str, str]
#: the height of a block of workers' output: past it the block scrolls, and keeps the latest
#: lines in view, so that a chatty cell does not push the dashboard down the page
OUTPUT_MAX_HEIGHT = "24em"
#: stderr lines, marked as JupyterLab marks a cell's own stderr
_STDERR = "background:var(--jp-rendermime-error-background, #fdd)"


def output_pre(lines: Sequence[OutputLine] = ()) -> str:
    """Workers' output lines, escaped, as a preformatted block of at most
    :data:`OUTPUT_MAX_HEIGHT` that scrolls; stderr lines marked."""
    body = "\n".join(f"<span class='nbdist-stderr' style='{_STDERR}'>{escape(text)}</span>"
                     if stream == "stderr" else escape(text) for stream, text in lines)
    # column-reverse keeps the scroll at the bottom: the latest lines stay in view
    return (f"<div class='nbdist-output-box' style='max-height:{OUTPUT_MAX_HEIGHT};"
            f"overflow-y:auto;display:flex;flex-direction:column-reverse'>"
            f"<pre class='nbdist-output' style='margin:0;flex:none;overflow:visible'>{body}"
            f"</pre></div>")


def rank_output_html(merged: Sequence[OutputLine],
                     per_rank: Sequence[tuple[int, Sequence[OutputLine]]]) -> str:
    """The static per-rank view a saved notebook keeps: the merged lines, then one
    collapsible block per rank (no widget state is needed to read it)."""
    ranks = "".join(f"<details class='nbdist-rank-output-{r}'><summary>rank {r}</summary>"
                    f"{output_pre(lines)}</details>" for r, lines in per_rank)
    return f"<div class='nbdist-rank-output-static'>{output_pre(merged)}{ranks}</div>"


def warnings_html(lines: Sequence[str]) -> str:
    """Warnings from the ranks, one per line, each naming its ranks, in the warning colour."""
    body = escape("\n".join(lines))
    return (f"<pre class='nbdist-warnings' style='color:{WARNED};"
            f"background:{WARNED_BACKGROUND};padding:4px'>{body}</pre>")
