"""Real browser: JupyterLab on loopback, headless Debian chromium driven by Playwright.

Runs a notebook with ``%%distributed`` training and checks the live dashboard's DOM (a bar per
rank advancing, the all-reduce chart), then clicks the cluster panel's Scale button. Screenshots
go to ``test-artifacts/`` (git-ignored).
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
ddp = DDP(torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(),
                              torch.nn.Linear(128, 4)), bucket_cap_mb=0.01)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
for i in nbdist.progress(range(60), desc="train"):
    loss = ddp(torch.randn(16, 32)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    nbdist.log(loss=loss)
    time.sleep(0.1)
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
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.set_default_timeout(60_000)
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
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def bar_width(page, rank: int) -> float:
    style = page.get_attribute(f".nbdist-rank-{rank} .progress-bar", "style") or ""
    for part in style.split(";"):
        k, _, v = part.partition(":")
        if k.strip() == "width" and v.strip().endswith("%"):
            return float(v.strip()[:-1])
    return 0.0


def stop_cluster(page) -> None:
    """Stop the kernel's workers from the notebook itself (the fixture kills leftovers)."""
    try:
        page.keyboard.press("Escape")
        page.keyboard.press("Control+Shift+c")
        page.fill(".lm-CommandPalette-input", "Shut Down All Kernels")
        page.keyboard.press("Enter")
    except sync_api.Error:
        pass


def test_dashboard_bars_advance_and_allreduce_chart_shows(browser, lab):
    page = open_notebook(browser, lab, "train.ipynb",
                         ["%load_ext nbdist\n%nbdist start -n 2", TRAIN])
    try:
        run_all(page)
        page.wait_for_selector(".nbdist-dashboard", timeout=180_000)
        for rank in (0, 1):
            page.wait_for_selector(f".nbdist-rank-{rank} .progress-bar")
        first = wait_for(lambda: min(bar_width(page, 0), bar_width(page, 1)) or None, 60,
                         "both bars to start")
        wait_for(lambda: min(bar_width(page, 0), bar_width(page, 1)) >= first + 10, 60,
                 "both bars to advance")
        page.wait_for_selector(".nbdist-chart svg.nbdist-allreduce-chart polyline")
        page.wait_for_selector(".nbdist-chart svg.nbdist-step-chart rect")
        shot(page, "dashboard-running.png")
        wait_for(lambda: bar_width(page, 0) == 100 and bar_width(page, 1) == 100, 90,
                 "training to finish")
        stats = page.inner_text(".nbdist-rank-0 ~ .widget-html, .nbdist-rank-row >> nth=0")
        assert "steps/s" in stats
        assert page.locator(".nbdist-rank-0.progress-bar-success, "
                            ".nbdist-rank-0 .progress-bar-success").count() == 1
        shot(page, "dashboard-finished.png")
    except Exception:
        shot(page, "dashboard-failure.png")
        raise
    finally:
        stop_cluster(page)
        page.close()


def test_cluster_panel_scale_button_changes_worker_count(browser, lab):
    page = open_notebook(browser, lab, "cluster.ipynb",
                         ["%load_ext nbdist\n%nbdist start -n 1", "%nbdist cluster"])
    try:
        run_all(page)
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
        shot(page, "cluster-scaled.png")
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
