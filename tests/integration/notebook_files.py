"""What the notebook tests share besides their fixtures (those are in ``conftest.py``): where
the checkout is, its numbered notebooks, and a saved cell's output as text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# The numbered notebooks, not the executed copies nbconvert writes beside them (git ignores those).
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb")
                   if not p.name.endswith(".nbconvert.ipynb"))


def outputs_text(cell: Any) -> str:
    """A code cell's output as text: streams, text/plain of results and displays, errors."""
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] in ("execute_result", "display_data"):
            parts.append(out["data"].get("text/plain", ""))
        elif out["output_type"] == "error":
            parts.append(f"{out['ename']}: {out['evalue']}")
    return "\n".join(parts)
