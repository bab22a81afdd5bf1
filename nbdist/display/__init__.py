"""Views of sessions and runs: text (baseline), static HTML, widgets. Never talks to engines."""

from __future__ import annotations

from .text import StreamView


def make_run_view(output: str, shown_rank: int, world_size: int) -> StreamView:
    """The view a run's event batches are fed to (``feed(batches)``, then ``close()``)."""
    return StreamView(output, shown_rank=shown_rank)
