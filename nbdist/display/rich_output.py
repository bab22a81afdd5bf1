"""What ranks displayed (IPython's ``display()``, matplotlib figures), shown under the cell.

The ranks send :data:`~nbdist.telemetry.events.DISPLAY` events (:mod:`nbdist.runtime.rich_output`);
:class:`RichOutput` publishes the shown ranks' ones with IPython's ``display`` in the running
cell, labelled with the rank, by the same rule as their printed lines: the shown rank's (the
lowest selected) by default, every rank's under ``--all-output``, none under ``--quiet``. A
``display_id`` stays the rank's own, so ``handle.update(...)`` on a rank replaces that rank's
display. Without IPython, the text form is printed.
"""

from __future__ import annotations

import html
import sys
from typing import Any, Optional, TextIO

from ..telemetry.events import Event

#: how a rank's label looks above its rich output
LABEL_STYLE = "font-size: smaller; opacity: 0.7; font-family: monospace"
_IMAGES = ("image/png", "image/jpeg", "image/gif")


def labelled(rank: int, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``rank``'s label: in its text, above its HTML, and above an image (shown
    as HTML with the label, the image's own type kept for other frontends).

    >>> labelled(1, {"text/plain": "x", "text/html": "<b>x</b>"})["text/html"][-8:]
    '<b>x</b>'
    >>> labelled(1, {"text/plain": "x"})
    {'text/plain': '[1] x'}
    """
    out = dict(data)
    label = f'<div class="nbdist-rank" style="{LABEL_STYLE}">[{rank}]</div>'
    out["text/plain"] = f"[{rank}] {data.get('text/plain', '')}"
    if isinstance(data.get("text/html"), str):
        out["text/html"] = label + data["text/html"]
    elif isinstance(data.get("image/svg+xml"), str):
        out["text/html"] = label + data["image/svg+xml"]
    else:
        for mime in _IMAGES:
            if isinstance(data.get(mime), str):
                out["text/html"] = (f'{label}<img src="data:{mime};base64,{data[mime]}" '
                                    f'alt="{html.escape(out["text/plain"], quote=True)}"/>')
                break
    return out


def _shell_display() -> Any:
    """IPython's ``display`` where a shell runs (a kernel, or terminal IPython); else None."""
    ipython = sys.modules.get("IPython")
    if ipython is None or ipython.get_ipython() is None:
        return None
    from IPython.display import display

    return display


class RichOutput:
    """Publishes the shown ranks' displays; ``mode`` and ``shown_rank`` as for printed lines."""

    def __init__(self, mode: str = "rank0", shown_rank: int = 0,
                 stdout: Optional[TextIO] = None) -> None:
        self.mode = mode
        self.shown_rank = shown_rank
        self._stdout = stdout
        self.shown = 0  # displays published (updates included)

    def wanted(self, rank: int) -> bool:
        return self.mode == "all" or (self.mode == "rank0" and rank == self.shown_rank)

    def feed(self, rank: int, event: Event) -> None:
        if not self.wanted(rank):
            return
        data = labelled(rank, event["data"])
        metadata = {**(event.get("metadata") or {}), "nbdist": {"rank": rank}}
        display_id = event.get("display_id")
        key = f"nbdist-{rank}-{display_id}" if display_id else None
        show = _shell_display()
        self.shown += 1
        if show is None:
            out = self._stdout or sys.stdout
            out.write(data["text/plain"] + "\n")
            out.flush()
        elif key is not None:
            show(data, raw=True, metadata=metadata, display_id=key,
                 update=bool(event.get("update")))
        else:
            show(data, raw=True, metadata=metadata)
