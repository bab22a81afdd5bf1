"""Real browser: JupyterLab on loopback, headless Debian chromium driven by Playwright.

Runs a notebook with ``%%distributed`` training where rank 1 is slower, checks the live
dashboard's DOM (rows that do not wrap at the default cell width, the straggler named), the
editor's line number in a traceback, then the cluster panel (Scale, and "stopped" after
``%nbdist stop`` without a click), and a breakpoint on rank 1 answered by typing into
JupyterLab's input box. Screenshots of the dashboard, the panel and the debugger go to
``docs/_static/screenshots/`` (the docs show them, so they are never stale); failure
screenshots to ``test-artifacts/`` (git-ignored).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

CHROMIUM = "/usr/bin/chromium"
NB = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook"  # the notebook on screen
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
SCREENSHOTS = ROOT / "docs" / "_static" / "screenshots"
#: the window the dashboard is designed for: JupyterLab's default cell width at 1400 px
VIEWPORT = {"width": 1400, "height": 1000}

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} not found (apt-get install -y chromium chromium-driver)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="playwright (pip install playwright) is not installed")
if shutil.which("jupyter-lab") is None and shutil.which("jupyter") is None:
    pytest.skip("jupyterlab is not installed", allow_module_level=True)

TRAIN = """%%distributed
import time, torch, nbdist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(rank)
ddp = DDP(torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(),
                              torch.nn.Linear(128, 4)), bucket_cap_mb=0.01)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
for i in nbdist.progress(range(100), desc="train"):
    time.sleep(0.05 + (0.02 if rank == 1 else 0.0))  # rank 1 computes 20 ms more per step
    loss = ddp(torch.randn(16, 32)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    nbdist.log(loss=loss)
"""
#: the editor's line 4 of this cell raises on rank 1 (line 1 is the magic's)
RAISE = """%%distributed
x = 1
if rank == 1:
    raise ValueError("bad shard")
"""


def notebook(cells: list[str]) -> dict:
    return {"nbformat": 4, "nbformat_minor": 5,
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                        "language": "python"}},
            "cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None,
                       "outputs": [], "source": src} for i, src in enumerate(cells)]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout: float, what: str, poll: float = 0.25):
    """Poll ``cond`` until it returns something truthy, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll)  # polling an external process / page; nothing to block on instead


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on loopback; every process it started is gone afterwards."""
    root = tmp_path_factory.mktemp("lab")
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JUPYTER_CONFIG_DIR=str(root / ".jupyter"),
               JUPYTER_RUNTIME_DIR=str(root / ".runtime"), NBDIST_DISPLAY="widget")
    log = open(root / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
         f"--port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--ServerApp.open_browser=False", "--LabApp.news_url=",
         "--LabServerApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        + (["--allow-root"] if os.geteuid() == 0 else []),
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up():
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                return r.status == 200
        except OSError:
            return server.poll() is not None and pytest.fail(
                "jupyter lab exited:\n" + (root / "server.log").read_text())
    try:
        wait_for(up, 120, "jupyter lab to answer")
        yield {"base": base, "token": token, "root": root}
    finally:
        # Everything the server started (kernels, and the engines a kernel started), by pid.
        family = [server]
        try:
            family += psutil.Process(server.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        try:
            req = urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST")
            urllib.request.urlopen(req, timeout=5).close()
            server.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for p in family:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs([p for p in family if isinstance(p, psutil.Process)], timeout=10)
        if server.poll() is None:
            server.kill()
        server.wait(10)
        log.close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking"])
        try:
            yield b
        finally:
            b.close()


def open_notebook(browser, lab, name: str, cells: list[str]):
    (lab["root"] / name).write_text(json.dumps(notebook(cells)))
    page = browser.new_page(viewport=VIEWPORT)
    page.set_default_timeout(60_000)
    # JupyterLab's notification toasts would cover the outputs in the docs' screenshots
    page.add_init_script("document.addEventListener('DOMContentLoaded', () => {"
                         "const s = document.createElement('style');"
                         "s.textContent = '.Toastify { display: none !important; }';"
                         "document.head.appendChild(s); });")
    # a workspace of its own, so a notebook left open by an earlier test is not restored
    page.goto(f"{lab['base']}/lab/workspaces/{Path(name).stem}/tree/{name}"
              f"?reset&token={lab['token']}")
    page.wait_for_selector(f"{NB} .jp-Cell", timeout=90_000)
    # cells render lazily: wait until every one is on the page with its prompt drawn
    wait_for(lambda: page.locator(f"{NB} .jp-Cell .jp-InputPrompt").count() == len(cells)
             and all(p.strip() for p in page.locator(
                 f"{NB} .jp-Cell .jp-InputPrompt").all_inner_texts()),
             60, "every cell to render")
    # the kernel is ready once the toolbar's status says idle
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                           timeout=120_000)
    return page


def accept_dialog(page) -> None:
    """Accept a dialog JupyterLab may raise on a slow start (e.g. "Select Kernel")."""
    dialog = page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept")
    if dialog.count():
        dialog.first.click()


def run_all(page):
    """Run > Run All Cells from the menu bar, retried until every cell is queued."""
    cells = page.locator(f"{NB} .jp-Cell")
    n = cells.count()

    def queued():
        # an unrun prompt reads "[ ]:" (with a no-break space); queued "[*]:", done "[1]:"
        return all("".join(cells.nth(i).locator(".jp-InputPrompt").inner_text().split())
                   != "[]:" for i in range(n))

    deadline = time.monotonic() + 60
    while not queued():
        if time.monotonic() > deadline:
            raise AssertionError("the notebook's cells never started running")
        accept_dialog(page)
        cells.nth(0).locator(".jp-InputPrompt").click()
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        try:
            wait_for(queued, 5, "cells to be queued")
        except AssertionError:
            page.keyboard.press("Escape")  # the kernel was not ready: close the menu, retry


def shot(page, name: str) -> None:
    """A full-page screenshot for a failure, in the git-ignored artifacts folder."""
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def doc_shot(locator, name: str) -> None:
    """A screenshot of one output, for the docs."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    locator.screenshot(path=str(SCREENSHOTS / name))


def cell(page, i: int):
    return page.locator(f"{NB} .jp-Cell").nth(i)


def prompt(page, i: int) -> str:
    return "".join(cell(page, i).locator(".jp-InputPrompt").inner_text().split())


def run_cells(page, first: int, last: int) -> None:
    """Run cells ``first`` to ``last`` with Shift+Enter, retried until they are queued."""
    deadline = time.monotonic() + 60
    while prompt(page, first) == "[]:":
        if time.monotonic() > deadline:
            raise AssertionError(f"cell {first} never started running")
        accept_dialog(page)
        cell(page, first).locator(".jp-InputPrompt").click()
        page.keyboard.press("Escape")  # command mode: Shift+Enter runs and selects the next
        for _ in range(first, last + 1):
            page.keyboard.press("Shift+Enter")
        try:
            wait_for(lambda: prompt(page, first) != "[]:", 5, "the cell to be queued")
        except AssertionError:
            pass
    wait_for(lambda: prompt(page, last) != "[]:", 30, f"cell {last} to be queued")


def bar_fill(page, rank: int) -> float:
    style = page.get_attribute(f".nbdist-rank-{rank} .nbdist-bar-fill", "style") or ""
    for part in style.split(";"):
        k, _, v = part.partition(":")
        if k.strip() == "width" and v.strip().endswith("%"):
            return float(v.strip()[:-1])
    return 0.0


#: per row of the run table: its height, and whether any numeric cell or header is cut short
LAYOUT = """table => {
  const numeric = new Set(["count", "rate", "ETA", "compute", "waiting", "transfer",
                           "bandwidth", "progress"]);
  const names = [...table.querySelectorAll("th")].map(th => th.textContent);
  const cut = el => el.scrollWidth > el.clientWidth + 1;
  const rows = [...table.querySelectorAll("tbody tr")].map(tr => ({
    height: tr.getBoundingClientRect().height,
    cut: [...tr.children].filter((td, i) => numeric.has(names[i]) && cut(td))
                         .map(td => td.textContent)}));
  const box = table.parentElement;
  return {rows, headerCut: [...table.querySelectorAll("th")].filter(cut).map(t => t.textContent),
          headHeight: table.querySelector("thead tr").getBoundingClientRect().height,
          tableWidth: table.getBoundingClientRect().width, boxWidth: box.clientWidth,
          scrolls: box.scrollWidth > box.clientWidth + 1};
}"""


def check_layout(page) -> dict:
    """Rows on one line each, numbers whole, the table inside the cell's width."""
    lay = page.locator(".nbdist-rows table.nbdist-table").evaluate(LAYOUT)
    heights = [r["height"] for r in lay["rows"]]
    assert heights and max(heights) - min(heights) < 1.5, lay
    assert max(heights) < 1.6 * 18, f"a row wraps: {lay}"  # one 18 px line plus padding
    assert not any(r["cut"] for r in lay["rows"]) and not lay["headerCut"], lay
    assert not lay["scrolls"] and lay["tableWidth"] <= lay["boxWidth"], lay
    return lay


def stop_cluster(page) -> None:
    """Stop the kernel's workers from the notebook itself (the fixture kills leftovers)."""
    try:
        page.keyboard.press("Escape")
        page.keyboard.press("Control+Shift+c")
        page.fill(".lm-CommandPalette-input", "Shut Down All Kernels")
        page.keyboard.press("Enter")
    except sync_api.Error:
        pass


def test_dashboard_reads_at_a_glance_and_tracebacks_use_editor_lines(browser, lab):
    page = open_notebook(browser, lab, "train.ipynb",
                         ["%load_ext nbdist\n%nbdist start -n 2", TRAIN, RAISE])
    try:
        run_all(page)
        page.wait_for_selector(".nbdist-dashboard", timeout=180_000)
        for rank in (0, 1):
            page.wait_for_selector(f".nbdist-rank-{rank} .nbdist-bar-fill")
        first = wait_for(lambda: min(bar_fill(page, 0), bar_fill(page, 1)) or None, 60,
                         "both bars to start")
        # mid-run: the slower rank is named in the header and marked in its row
        header = ".nbdist-dashboard .nbdist-header"
        wait_for(lambda: "rank 1 is" in page.inner_text(header)
                 and page.locator(".nbdist-rank-1.nbdist-straggler").count(), 60,
                 "rank 1 to be named as the rank the others wait for")
        wait_for(lambda: min(bar_fill(page, 0), bar_fill(page, 1)) >= first + 10, 60,
                 "both bars to advance")
        page.wait_for_selector(".nbdist-chart svg.nbdist-bandwidth-chart polyline")
        page.wait_for_selector(".nbdist-chart svg.nbdist-step-chart rect")
        page.wait_for_selector(".nbdist-chart svg.nbdist-scalar-chart polyline")
        text = page.inner_text(header)
        assert "running for" in text and "others wait" in text and "bandwidth" in text, text
        check_layout(page)
        dashboard = cell(page, 1).locator(".jp-OutputArea")
        doc_shot(dashboard, "dashboard-running.png")
        wait_for(lambda: "finished in" in page.inner_text(header), 120, "training to finish")
        assert bar_fill(page, 0) == 100 and bar_fill(page, 1) == 100
        # the straggler's colour survives the end of the run
        assert page.locator(".nbdist-rank-1.nbdist-straggler").count() == 1
        lay = check_layout(page)
        assert len(lay["rows"]) == 2
        row = page.inner_text(".nbdist-rank-0")
        for unit in ("100/100 it", "it/s", "ms", "B/s", "loss"):
            assert unit in row, row
        doc_shot(dashboard, "dashboard-finished.png")
        # the traceback names the editor's line of the raise, and the cell by its number
        error = cell(page, 2).locator(".jp-OutputArea-output[data-mime-type="
                                      "'application/vnd.jupyter.stderr']")
        error.wait_for(timeout=60_000)
        editor_lines = cell(page, 2).locator(".cm-line").all_inner_texts()
        raising = next(i for i, line in enumerate(editor_lines, 1) if "raise" in line)
        tb = error.inner_text()
        assert raising == 4 and f"In [3], line {raising}" in tb, tb
        assert f'"<distributed cell [3]>", line {raising}' in tb, tb
    except Exception:
        shot(page, "dashboard-failure.png")
        raise
    finally:
        stop_cluster(page)
        page.close()


def test_cluster_panel_scales_refreshes_itself_and_says_stopped(browser, lab):
    page = open_notebook(browser, lab, "cluster.ipynb",
                         ["%load_ext nbdist\n%nbdist start -n 1", "%nbdist cluster",
                          "%nbdist stop"])
    try:
        run_cells(page, 0, 1)
        page.wait_for_selector(".nbdist-cluster .nbdist-cluster-table tbody tr",
                               timeout=180_000)
        assert page.locator(".nbdist-cluster-table tbody tr").count() == 1
        box = page.locator(".nbdist-cluster .widget-text input")
        box.fill("2")
        box.press("Enter")
        page.click(".nbdist-cluster button.nbdist-scale")
        wait_for(lambda: page.locator(".nbdist-cluster-table tbody tr").count() == 2, 180,
                 "the panel to show 2 workers")
        assert "re-formed" in page.inner_text(".nbdist-cluster-message")
        # it refreshes itself: the "updated" clock moves without a click
        note = ".nbdist-cluster .nbdist-cluster-note"
        before = page.inner_text(note)
        wait_for(lambda: page.inner_text(note) != before, 15, "the panel to refresh itself")
        panel = cell(page, 1).locator(".jp-OutputArea")
        doc_shot(panel, "cluster-panel.png")
        run_cells(page, 2, 2)
        wait_for(lambda: "[*]" not in prompt(page, 2), 60, "%nbdist stop to finish")
        assert "stopped 2 workers" in cell(page, 2).locator(".jp-OutputArea").inner_text()
        wait_for(lambda: "stopped" in page.inner_text(".nbdist-cluster-table"), 15,
                 "the panel to say stopped")
        table = page.inner_text(".nbdist-cluster-table")
        assert "workers alive" not in table and "`" not in table, table
        doc_shot(panel, "cluster-panel-stopped.png")
    except Exception:
        shot(page, "cluster-failure.png")
        raise
    finally:
        stop_cluster(page)
        page.close()


def test_all_output_per_rank_tabs_and_folded_lines(browser, lab):
    page = open_notebook(browser, lab, "ranks.ipynb", [
        "%load_ext nbdist\n%nbdist start -n 2",
        "%%distributed --all-output\nfor e in range(2):\n    print(f'epoch {e} done')\n"
        "print(f'only rank {rank}')"])
    view = ".nbdist-rank-output"
    try:
        run_all(page)
        page.wait_for_selector(f"{view} .nbdist-output-merged pre", timeout=180_000)
        wait_for(lambda: "only rank 1" in page.inner_text(f"{view} .nbdist-output-merged"), 60,
                 "both ranks' lines in the merged tab")
        merged = page.inner_text(f"{view} .nbdist-output-merged")
        assert "[0-1] epoch 0 done\n[0-1] epoch 1 done" in merged
        assert "[0] only rank 0" in merged and "[1] only rank 1" in merged
        tabs = page.locator(f"{view} .lm-TabBar-tab")
        assert tabs.all_inner_texts() == ["all ranks", "rank 0", "rank 1"]
        tabs.nth(2).click()
        page.wait_for_selector(f"{view} .nbdist-output-rank-1", state="visible")
        rank1 = page.inner_text(f"{view} .nbdist-output-rank-1")
        assert "only rank 1" in rank1 and "epoch 1 done" in rank1 and "[" not in rank1
        assert not page.locator(f"{view} .nbdist-output-merged").is_visible()
        shot(page, "rank-output-tabs.png")
    except Exception:
        shot(page, "rank-output-failure.png")
        raise
    finally:
        stop_cluster(page)
        page.close()


#: rank 1 stops at a breakpoint while rank 0 waits for it in the all_reduce
BREAKPOINT = """%%distributed
import torch, torch.distributed as dist
x = torch.tensor([float(rank + 1)])
if rank == 1:
    breakpoint()
dist.all_reduce(x)
x.item()
"""


#: the input box JupyterLab shows: it hides a box (and draws it anew below) when output
#: arrives above it, so for a moment there are two, one of them hiding
STDIN = ".jp-OutputArea-stdin-item:not(.jp-OutputArea-stdin-hiding) .jp-Stdin"


def input_box(out, timeout: float = 60):
    """The cell's input box, once a prompt of rank 1's pdb is shown in it."""
    box = out.locator(f"{STDIN} .jp-Stdin-input:not([readonly])")  # answered: read-only
    wait_for(lambda: box.count() == 1, timeout, "an input box")
    assert out.locator(f"{STDIN} .jp-Stdin-prompt").inner_text().strip() == "(Pdb rank 1)"
    return box


def answer(out, line: str) -> None:
    """Type ``line`` into the cell's input box, and wait until the output shows it sent."""
    box = input_box(out)
    box.fill(line)
    box.press("Enter")
    # JupyterLab replaces the box with the prompt and the line typed
    wait_for(lambda: f"(Pdb rank 1) {line}" in " ".join(out.inner_text().split()), 60,
             f"{line!r} to be sent")


def test_a_breakpoint_on_rank_1_is_answered_in_jupyterlabs_input_box(browser, lab):
    page = open_notebook(browser, lab, "debug.ipynb",
                         ["%load_ext nbdist\n%nbdist start -n 2", BREAKPOINT])
    out = cell(page, 1).locator(".jp-OutputArea")
    try:
        run_all(page)
        input_box(out, 240)  # the workers start first
        answer(out, "p x")
        wait_for(lambda: "tensor([2.])" in out.inner_text(), 60, "pdb to print x")
        text = out.inner_text()
        assert "rank 1 is in the debugger at In [2], line 6" in text, text
        assert "hang doctor: rank 1 is in the debugger (line 6)" in text, text
        assert "-> dist.all_reduce(x)" in text, text
        answer(out, "x = torch.tensor([10.0])")
        # the screenshot: the session so far, and the input box with "c" typed in it
        input_box(out).fill("c")
        doc_shot(out, "debugger.png")
        answer(out, "c")  # typed again, in case the box was drawn anew meanwhile
        # rank 1's assignment took part in rank 0's all_reduce: 1 + 10
        wait_for(lambda: "[*]" not in prompt(page, 1), 120, "the cell to finish")
        text = out.inner_text()
        assert "11.0" in text and "Traceback" not in text, text
    except Exception:
        shot(page, "debugger-failure.png")
        (ARTIFACTS / "debugger-failure.html").write_text(out.inner_html())
        raise
    finally:
        stop_cluster(page)
        page.close()
