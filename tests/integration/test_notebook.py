"""The quickstart notebook, executed headlessly in a real kernel through nbclient."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"

pytestmark = pytest.mark.timeout(420)


def outputs_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] in ("execute_result", "display_data"):
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


def test_quickstart_trains_on_two_workers():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel runs in the repository so that it imports this checkout.
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError on any failing cell (the notebook asserts)
    code = [c for c in nb.cells if c.cell_type == "code"]
    text = "\n".join(outputs_text(c) for c in code)
    assert "[0] rank 0/2" in text and "[1] rank 1/2" in text
    assert "'replicas_agree': True" in text
    assert "accuracy of the pulled model on held-out data" in text
    # The telemetry summary stays in the saved notebook as static HTML.
    html = [o["data"]["text/html"] for c in code for o in c.get("outputs", [])
            if o["output_type"] in ("execute_result", "display_data")
            and "text/html" in o["data"]]
    assert any("nbdist-summary" in h and "<svg" in h for h in html)
