"""Event records that flow from workers to the notebook, as plain dicts.

Workers batch events; a batch is ``{"rank": int, "seq": int, "events": [event, ...]}``, and
``seq`` counts batches per rank so the notebook can tell when it has seen everything a cell sent.
"""

from __future__ import annotations

from typing import Any

STREAM = "stream"  # {"kind", "name": "stdout"|"stderr", "text"}

Event = dict[str, Any]
Batch = dict[str, Any]


def stream(name: str, text: str) -> Event:
    return {"kind": STREAM, "name": name, "text": text}
