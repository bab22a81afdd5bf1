"""The strategies notebook, executed headlessly in a real kernel: five runs and their table."""

from __future__ import annotations

from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "strategies.ipynb"


@pytest.mark.timeout(420)
def test_strategies_notebook_compares_five_runs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # the notebook's own asserts check what each strategy promises
    html = [o["data"]["text/html"] for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if o["output_type"] in ("execute_result",
                                                                 "display_data")
            and "text/html" in o["data"]]
    compare = [h for h in html if "nbdist-compare" in h]
    assert compare, "%nbdist compare showed nothing"
    for run in ("ddp", "ddp+fp16", "ddp+powersgd", "zero1", "fsdp2"):
        assert f">{run}</td>" in compare[-1]
    assert "<svg" in compare[-1]
