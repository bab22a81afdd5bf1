"""The documentation's examples run as written.

Each page's ```` ```python ```` blocks, in order, are the cells of one fresh notebook, run in a
fresh kernel on this machine, in an empty working directory. The README and Getting started
stand alone; the other pages assume the session Getting started makes
(``%load_ext nbdist``, ``%nbdist start -n 2``, 2 CPU workers here), which the test starts
first where the page does not. A block that cannot run here says why on a line of its own:

* ``# needs: ...`` (a GPU, a Slurm cluster, your train.py, a package the suite does not
  install), or
* ``# synopsis`` (a reference listing, or an excerpt of a notebook that runs it whole);

it is still checked to be valid IPython. Pages whose blocks all carry a marker are only
checked, not run. ``PAGES`` must name every page with Python blocks, so a new page is not
silently left out.
"""

from __future__ import annotations

import os
import re
import time

import pytest
from notebook_files import ROOT, outputs_text

pytestmark = pytest.mark.timeout(600)

MARKER = re.compile(r"^\s*# (needs: \S.*|synopsis\b.*)$", re.M)
#: what the other pages assume has run (docs/getting-started.md says so)
PRELUDE = "%load_ext nbdist\n%nbdist start -n 2"
STANDALONE = {"README.md", "docs/getting-started.md"}
#: the pages, in the order a reader meets them; each runs in a fresh notebook
PAGES = ["README.md", "docs/index.md", "docs/getting-started.md", "docs/usage.md",
         "docs/telemetry.md", "docs/tuning.md", "docs/strategies.md", "docs/parallelism.md",
         "docs/huggingface.md", "docs/lightning.md", "docs/deepspeed.md",
         "docs/fault-tolerance.md", "docs/debugging.md", "docs/dask.md",
         "docs/clusters.md", "docs/profiles.md",
         "docs/export.md", "docs/faq.md", "docs/troubleshooting.md", "docs/gpu.md"]


def python_blocks(page: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every ```` ```python ```` block of ``page``."""
    text = (ROOT / page).read_text(encoding="utf-8")
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def cell_seconds(cell) -> float:
    """How long nbclient took to run ``cell`` (its recorded timing)."""
    from datetime import datetime

    t = cell.metadata.get("execution", {})
    start, end = t.get("iopub.execute_input"), t.get("shell.execute_reply")
    if not (start and end):
        return float("nan")
    parse = datetime.fromisoformat
    return (parse(end.replace("Z", "+00:00")) - parse(start.replace("Z", "+00:00"))
            ).total_seconds()


def runnable(code: str) -> bool:
    return MARKER.search(code) is None


def test_every_page_with_python_blocks_is_covered():
    pages = {str(p.relative_to(ROOT)) for p in [ROOT / "README.md", *ROOT.glob("docs/*.md")]
             if python_blocks(str(p.relative_to(ROOT)))}
    assert pages <= set(PAGES), sorted(pages - set(PAGES))


@pytest.mark.parametrize("page", PAGES)
def test_every_block_is_valid_ipython(page):
    from IPython.core.inputtransformer2 import TransformerManager

    if not (ROOT / page).exists():
        pytest.skip(f"{page} does not exist")
    for line, code in python_blocks(page):
        python = TransformerManager().transform_cell(code)
        compile(python, f"{page}:{line}", "exec")  # a SyntaxError names the block


@pytest.mark.parametrize("page", [p for p in PAGES if (ROOT / p).exists()
                                  and any(runnable(c) for _, c in python_blocks(p))])
def test_the_page_s_blocks_run_in_order_in_a_fresh_notebook(page, tmp_path, record_property):
    import nbclient
    import nbformat

    blocks = [(line, code) for line, code in python_blocks(page) if runnable(code)]
    starts = any(re.search(r"%nbdist (start|connect)|nbdist\.(start|connect)\(", code)
                 for _, code in blocks)
    if not starts:
        assert page not in STANDALONE, f"{page} must start its own cluster"
        blocks.insert(0, (0, PRELUDE))
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(code.rstrip("\n")) for _, code in blocks]
    # Not the page's: whatever it left running is stopped with the kernel's cluster.
    nb.cells.append(nbformat.v4.new_code_cell("import nbdist\nnbdist.stop()"))
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.monotonic()
    try:
        client.execute(env=dict(os.environ, PYTHONPATH=str(ROOT)))
    except nbclient.exceptions.CellExecutionError as exc:
        failed = [f"{page}:{line}" for (line, _), cell in zip(blocks, nb.cells)
                  if any(o["output_type"] == "error" for o in cell.get("outputs", []))]
        pytest.fail(f"the block at {failed[0] if failed else page} failed:\n{exc}",
                    pytrace=False)
    seconds = round(time.monotonic() - t0, 1)
    record_property("seconds", seconds)
    print(f"{page}: {len(blocks)} blocks in {seconds} s:", ", ".join(
        f"line {line} {cell_seconds(cell):.1f} s" for (line, _), cell in zip(blocks, nb.cells)))
    for (line, _), cell in zip(blocks, nb.cells):
        assert "Traceback" not in outputs_text(cell), f"{page}:{line}: {outputs_text(cell)}"
