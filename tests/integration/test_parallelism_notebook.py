"""The parallelism notebook, executed headlessly in a real kernel: five runs and their table."""

from __future__ import annotations

from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "parallelism.ipynb"


@pytest.mark.timeout(420)
def test_parallelism_notebook_compares_five_runs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # the notebook's own asserts check what each approach promises
    html = [o["data"]["text/html"] for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if o["output_type"] in ("execute_result",
                                                                 "display_data")
            and "text/html" in o["data"]]
    compare = [h for h in html if "nbdist-compare" in h]
    assert compare, "%nbdist compare showed nothing"
    for run in ("ddp", "pipeline", "tensor-parallel", "parameter-server", "local-sgd"):
        assert f"<td>{run}</td>" in compare[-1]
    assert "<th>bubble</th>" in compare[-1]
    # the pipeline cell's summary shows each stage and its bubble
    assert any("ScheduleGPipe" in h and "stage 1/2" in h for h in html)
