"""Real browser: JupyterLab on loopback, headless Debian chromium driven by Playwright.

One JupyterLab server and one notebook, with its kernel and a two-worker cluster, serve the
whole module; each test runs its own cells of that notebook, in file order, and reads what a
user must read: the header's and the rows' text, the step count, the chart's step range, no
verdict cut short, clocks that move. The everyday dashboard (a straggler, the editor's line
in a traceback), then what breaks: a straggler with nested tqdm bars, a rank killed and
replaced in elastic training, a hang with ``--stall-after`` and ``--timeout`` (read again at
1280 px with the file browser open), a chatty ``--all-output`` cell run twice, the dark
theme, and the cluster panel (Scale, the Scale box following ``%nbdist scale``, "stopped"
after ``%nbdist stop``); last, in a notebook of its own, a breakpoint on rank 1 answered by
typing into JupyterLab's input box. Screenshots go to ``docs/_static/screenshots/`` (the docs
show them, so they are never stale); failure screenshots to ``test-artifacts/`` (git-ignored).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
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

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

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
#: nested tqdm bars, DDP, rank 1 slower: rows must name their bar and never look ahead
TQDM = """%%distributed
import time, torch
from tqdm.auto import tqdm, trange
from torch.nn.parallel import DistributedDataParallel as DDP
ddp = DDP(torch.nn.Linear(32, 4))
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
for epoch in trange(3, desc="epochs"):
    for i in tqdm(range(40), desc=f"epoch {epoch}"):
        time.sleep(0.03 + (0.04 if rank == 1 else 0.0))  # rank 1 computes 40 ms more
        loss = ddp(torch.randn(8, 32)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
"""
ELASTIC_SETUP = """%%distributed
import os, time, torch, torch.distributed as dist, nbdist
torch.manual_seed(0)
net = torch.nn.Linear(8, 1)
state = nbdist.elastic.State(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
                             step=0)

def full_width(state):
    \"\"\"Commit until a replacement is in (it joins at a commit).\"\"\"
    deadline = time.time() + 150
    while dist.get_world_size() < 2 and time.time() < deadline:
        time.sleep(0.1)
        state.commit()

@nbdist.elastic.run
def train(state, steps, kill_at, rejoin_at, flag):
    \"\"\"Rank 1 SIGKILLs itself after step kill_at; rank 0 trains alone until rejoin_at,
    then waits for the replacement; the rest is at full width again.\"\"\"
    while state.step < steps:
        loss = state.model(torch.randn(16, 8)).pow(2).mean()
        state.optimizer.zero_grad()
        loss.backward()
        for p in state.model.parameters():
            dist.all_reduce(p.grad)
        state.optimizer.step()
        state.step += 1
        state.commit()
        nbdist.log(loss=loss)
        time.sleep(0.1)
        if state.step == kill_at and not os.path.exists(flag) and dist.get_rank() == 1:
            open(flag, "w").close()
            os.kill(os.getpid(), 9)
        if state.step == rejoin_at:
            full_width(state)
"""
#: 50 steps: 0-9 on two ranks, then rank 0 alone until the replacement joins (at step 30
#: at the latest), the rest with the replacement
ELASTIC_RUN = "%%distributed\ntrain(state, 50, 10, 30, {flag!r})\n"
#: rank 1 never reaches the all-reduce of step 20; the hang doctor at 8 s (the quiet word shows
#: from 2 s: a window a loaded machine still catches), the timeout at 20 s
HANG = """%%distributed --stall-after 8 --timeout 20
import time, torch, torch.distributed as dist, nbdist
for i in nbdist.progress(range(1000), desc="train"):
    if i == 20 and rank == 1:
        time.sleep(600)  # rank 1 never reaches the next all_reduce
    dist.all_reduce(torch.ones(4))
    time.sleep(0.1)
"""
#: many lines, some on stderr, and a warning (run twice: it shows both times)
CHATTY = """%%distributed --all-output
import sys, time, warnings, nbdist
for i in nbdist.progress(range(150), desc="chatty"):
    print(f"step {i}: loss {1 / (i + 1):.4f}")
    if i % 50 == 0:
        print(f"checkpoint {i} written", file=sys.stderr)
    time.sleep(0.02)
print(f"only rank {rank}")
warnings.warn("this shard is small")
"""
CELLS = ["%load_ext nbdist\n%nbdist start -n 2", TRAIN, RAISE, TQDM, ELASTIC_SETUP,
         ELASTIC_RUN, HANG, CHATTY, "%nbdist cluster", "%nbdist scale 2", "%nbdist stop"]
C_START, C_TRAIN, C_RAISE, C_TQDM, C_SETUP, C_KILL, C_HANG, C_CHATTY, C_PANEL, C_SCALE, \
    C_STOP = range(len(CELLS))


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
    with jupyter_server(tmp_path_factory.mktemp("lab")) as served:
        yield served


@contextlib.contextmanager
def jupyter_server(root: Path, **env_extra: str):
    """A Jupyter server (JupyterLab, and Notebook 7 where installed) on loopback serving
    ``root``, with ``env_extra`` in its environment; every process it started is gone
    afterwards. Yields ``{"base", "token", "root"}``."""
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JUPYTER_CONFIG_DIR=str(root / ".jupyter"),
               JUPYTER_RUNTIME_DIR=str(root / ".runtime"), NBDIST_DISPLAY="widget", **env_extra)
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
    """``[ ]:`` (never run), ``[*]:`` (queued or running) or ``[3]:``, as its text: a cell
    JupyterLab has not laid out (off screen) has no inner text yet."""
    return "".join((cell(page, i).locator(".jp-InputPrompt").text_content() or "").split())


def run_cells(page, first: int, last: int) -> None:
    """Queue cells ``first`` to ``last`` in order, each with its own Ctrl+Enter.

    One key press per cell, checked before the next: a Shift+Enter sent while JupyterLab is
    still moving the selection can be lost, leaving a later cell unrun.
    """
    for i in range(first, last + 1):
        deadline = time.monotonic() + 60
        while not started(page, i):
            if time.monotonic() > deadline:
                raise AssertionError(f"cell {i} never started running (its prompt reads "
                                     f"{prompt(page, i)!r})")
            accept_dialog(page)
            cell(page, i).locator(".jp-InputPrompt").click()
            page.keyboard.press("Escape")  # command mode: Ctrl+Enter runs the selected cell
            page.keyboard.press("Control+Enter")
            try:
                wait_for(lambda i=i: started(page, i), 10, f"cell {i} to be queued")
            except AssertionError:
                pass


def out(page, i: int):
    """Cell ``i``'s output area."""
    return cell(page, i).locator(".jp-OutputArea")


def started(page, i: int) -> bool:
    """Cell ``i`` is queued, running or has run: its prompt reads ``[*]:`` or a number. An
    empty prompt is not that (a cell JupyterLab has not laid out has no prompt text yet):
    read as started, it would leave the cell unrun, as the breakpoint cell once was in CI."""
    return re.fullmatch(r"\[(\*|\d+)\]:", prompt(page, i)) is not None


def finished(page, i: int) -> bool:
    """Cell ``i`` has run: its prompt reads a number (not ``[*]:``, nor empty while it is
    laid out again)."""
    return re.fullmatch(r"\[\d+\]:", prompt(page, i)) is not None


def text(locator) -> str:
    return locator.inner_text() if locator.count() else ""


def bar_fill(view, rank: int) -> float:
    style = view.locator(f".nbdist-rank-{rank} .nbdist-bar-fill").first.get_attribute(
        "style") or ""
    for part in style.split(";"):
        k, _, v = part.partition(":")
        if k.strip() == "width" and v.strip().endswith("%"):
            return float(v.strip()[:-1])
    return 0.0


#: per row of the run table: its height, whether any numeric cell or header is cut short,
#: and every cell cut short without a title to hover
LAYOUT = """table => {
  const numeric = new Set(["count", "rate", "ETA", "compute", "waiting", "transfer",
                           "bandwidth"]);
  const names = [...table.querySelectorAll("th")].map(th => th.textContent);
  const cut = el => el.scrollWidth > el.clientWidth + 1;
  const rows = [...table.querySelectorAll("tbody tr")].map(tr => ({
    height: tr.getBoundingClientRect().height,
    cut: [...tr.children].filter((td, i) => numeric.has(names[i]) && cut(td))
                         .map(td => td.textContent),
    untitled: [...tr.children].filter(td => cut(td) && !td.title).map(td => td.textContent),
    state: tr.lastElementChild.textContent,
    stateCut: cut(tr.lastElementChild) && !tr.lastElementChild.title,
    stateRight: tr.lastElementChild.getBoundingClientRect().right}));
  const box = table.parentElement;
  const area = box.getBoundingClientRect();
  return {rows, headerCut: [...table.querySelectorAll("th")].filter(t => cut(t) && !t.title)
                                                           .map(t => t.textContent),
          headHeight: table.querySelector("thead tr").getBoundingClientRect().height,
          tableWidth: table.getBoundingClientRect().width, boxWidth: box.clientWidth,
          scrolls: box.scrollWidth > box.clientWidth + 1, areaRight: area.right,
          windowWidth: window.innerWidth};
}"""


#: numbered marks over parts of an output, for the docs' annotated screenshot: ``notes`` is
#: ``[[selector, number, dx], ...]``; each mark sits at its part's top, ``dx`` px from its
#: left edge (22 px left of it unless given)
ANNOTATE = """(area, notes) => {
  area.style.position = "relative";
  const o = area.getBoundingClientRect();
  for (const [sel, n, dx = -22] of notes) {
    const r = area.querySelector(sel).getBoundingClientRect();
    const x = r.left + dx;
    const b = document.createElement("div");
    b.className = "nbdist-annotation";
    b.textContent = n;
    Object.assign(b.style, {position: "absolute", left: `${x - o.left}px`,
      top: `${r.top - o.top}px`, width: "18px", height: "18px", borderRadius: "9px",
      background: "#d62728", color: "#fff", font: "bold 12px/18px sans-serif",
      textAlign: "center", zIndex: 10});
    area.appendChild(b);
  }
}"""
#: what the annotated screenshot numbers (docs/telemetry.md explains each number)
NOTES = [[".nbdist-header > div:first-child", 1], [".nbdist-header > div:nth-child(2)", 2],
         [".nbdist-rows tr.nbdist-rank-1", 3], [".nbdist-rows th:last-child", 4, 44],
         [".nbdist-memory table", 5], [".nbdist-legend", 6], [".nbdist-step-chart", 7],
         [".nbdist-bandwidth-chart", 8], [".nbdist-scalar-chart", 9]]


def layout(view) -> dict:
    return view.locator(".nbdist-rows table.nbdist-table").first.evaluate(LAYOUT)


def check_layout(view, one_line: bool = True, fits: bool = True) -> dict:
    """Numbers whole, every cut cell titled, the state column never cut and on screen;
    ``one_line``: rows on one line each; ``fits``: the table inside the cell's width (else it
    may scroll, its state column staying in view)."""
    lay = layout(view)
    heights = [r["height"] for r in lay["rows"]]
    if one_line:
        assert heights and max(heights) - min(heights) < 1.5, lay
        assert max(heights) < 1.6 * 18, f"a row wraps: {lay}"  # one 18 px line plus padding
    assert not any(r["cut"] for r in lay["rows"]) and not lay["headerCut"], lay
    assert not any(r["untitled"] for r in lay["rows"]), lay
    assert not any(r["stateCut"] for r in lay["rows"]), lay
    assert all(r["stateRight"] <= min(lay["areaRight"], lay["windowWidth"]) + 1
               for r in lay["rows"]), f"the state column is off-screen: {lay}"
    if fits:
        assert not lay["scrolls"] and lay["tableWidth"] <= lay["boxWidth"], lay
    return lay


def row_text(view, selector: str) -> str:
    """The text of one row of a dashboard's run table (``.nbdist-rank-1``...)."""
    return text(view.locator(f".nbdist-rows tr{selector}").first)


def state_of(view, selector: str) -> str:
    return text(view.locator(f".nbdist-rows tr{selector} td:last-child").first)


def run_again(page, i: int) -> None:
    """Run cell ``i`` once more (Ctrl+Enter in command mode) and wait for it to be queued."""
    before = prompt(page, i)
    cell(page, i).locator(".jp-InputPrompt").click()
    page.keyboard.press("Escape")
    page.keyboard.press("Control+Enter")
    wait_for(lambda: prompt(page, i) != before, 30, f"cell {i} to run again")


def stop_cluster(page) -> None:
    """Stop the kernel's workers from the notebook itself (the fixture kills leftovers)."""
    try:
        page.keyboard.press("Escape")
        page.keyboard.press("Control+Shift+c")
        page.fill(".lm-CommandPalette-input", "Shut Down All Kernels")
        page.keyboard.press("Enter")
    except sync_api.Error:
        pass


def command(page, label: str) -> None:
    """Run a command by its label from JupyterLab's command palette."""
    page.keyboard.press("Escape")
    page.keyboard.press("Control+Shift+c")
    page.fill(".lm-CommandPalette-input", label)
    page.locator(".lm-CommandPalette-item", has_text=label).first.click()


@pytest.fixture(scope="module")
def flag(tmp_path_factory) -> Path:
    """The file the elastic cell's rank 1 leaves before it kills itself (once)."""
    return tmp_path_factory.mktemp("elastic") / "killed"


@pytest.fixture(scope="module")
def nb(browser, lab, flag):
    """The module's notebook, its kernel and a two-worker cluster (cell 0 ran)."""
    cells = list(CELLS)
    cells[C_KILL] = ELASTIC_RUN.format(flag=str(flag))
    page = open_notebook(browser, lab, "dashboard.ipynb", cells)
    try:
        run_cells(page, C_START, C_START)
        wait_for(lambda: finished(page, C_START), 240, "the cluster to start")
        yield page
    except Exception:
        shot(page, "start-failure.png")
        raise
    finally:
        stop_cluster(page)
        page.close()


def test_a_start_says_how_many_workers_are_ready(nb):
    started = out(nb, C_START).inner_text()
    assert "nbdist: 2 of 2 workers ready in" in started, started
    assert "Error" not in started, started


def test_dashboard_reads_at_a_glance_and_tracebacks_use_editor_lines(nb):
    page, view = nb, out(nb, C_TRAIN)
    try:
        run_cells(page, C_TRAIN, C_RAISE)
        view.locator(".nbdist-dashboard").wait_for(timeout=120_000)
        for rank in (0, 1):
            view.locator(f".nbdist-rank-{rank} .nbdist-bar-fill").wait_for()
        first = wait_for(lambda: min(bar_fill(view, 0), bar_fill(view, 1)) or None, 60,
                         "both bars to start")
        # mid-run: the slower rank is named in the header and marked in its row
        header = view.locator(".nbdist-dashboard .nbdist-header")
        wait_for(lambda: "rank 1 is" in header.inner_text()
                 and view.locator(".nbdist-rank-1.nbdist-straggler").count(), 60,
                 "rank 1 to be named as the rank the others wait for")
        wait_for(lambda: min(bar_fill(view, 0), bar_fill(view, 1)) >= first + 10, 60,
                 "both bars to advance")
        # drawn: lines and bars while the run goes on, images once it is over
        for chart in (".nbdist-bandwidth-chart :is(polyline, img)",
                      ".nbdist-step-chart :is(rect, img)",
                      ".nbdist-scalar-chart :is(polyline, img)"):
            view.locator(f".nbdist-chart {chart}").first.wait_for()
        head = header.inner_text()
        assert "running for" in head and "others wait" in head and "bandwidth" in head, head
        check_layout(view)
        doc_shot(view, "dashboard-running.png")
        wait_for(lambda: "finished in" in header.inner_text(), 120, "training to finish")
        # the live widget says "finished" a moment before the run's end puts the static
        # summary in its place (charts as images, their words as labels): read that one
        view.locator(".nbdist-step-chart img").wait_for(timeout=60_000)
        assert bar_fill(view, 0) == 100 and bar_fill(view, 1) == 100
        # the straggler's colour survives the end of the run
        assert view.locator(".nbdist-rank-1.nbdist-straggler").count() == 1
        lay = check_layout(view)
        assert len(lay["rows"]) == 2
        row = row_text(view, ".nbdist-rank-0")
        for unit in ("100/100 it", "it/s", "ms", "B/s", "loss"):
            assert unit in row, row
        # the job's count, and which figures are one rank's and which the job's
        head = header.inner_text()
        assert "finished in" in head and "train 100/100 it" in head, head
        assert re.search(r"it/s per rank · [0-9.]+k? samples/s all ranks", head), head
        assert re.search(r"bandwidth [0-9.]+ [kMG]?B/s per rank", head), head
        # every step on the chart; the memory table says what it shows
        labels = view.locator(".nbdist-step-chart .nbdist-chart-label").all_text_contents()
        assert "step 0" in labels and "step 99" in labels, labels
        assert view.locator(".nbdist-memory caption").inner_text().startswith(
            "memory per rank")
        # rank 1 has one colour: its mark in the table, its name over the loss chart (the
        # line's pixels are that colour: tests/unit/display/test_static_charts.py)
        swatch = view.locator(".nbdist-rank-1 .nbdist-swatch").first.evaluate(
            "e => getComputedStyle(e).backgroundColor")
        line = view.locator(".nbdist-scalar-chart .nbdist-chart-label span",
                            has_text="rank 1").first.evaluate("e => getComputedStyle(e).color")
        assert swatch == line, (swatch, line)
        doc_shot(view, "dashboard-finished.png")
        view.evaluate(ANNOTATE, NOTES)
        try:
            doc_shot(view, "dashboard-annotated.png")
        finally:
            view.evaluate("a => a.querySelectorAll('.nbdist-annotation').forEach(e => e.remove())")
        # the traceback names the editor's line of the raise, and the cell by its number
        error = cell(page, C_RAISE).locator(".jp-OutputArea-output[data-mime-type="
                                            "'application/vnd.jupyter.stderr']")
        error.wait_for(timeout=60_000)
        editor_lines = cell(page, C_RAISE).locator(".cm-line").all_inner_texts()
        raising = next(i for i, line in enumerate(editor_lines, 1) if "raise" in line)
        tb = error.inner_text()
        n = prompt(page, C_RAISE).strip("[]:")
        assert raising == 4 and f"In [{n}], line {raising}" in tb, tb
        assert f'"<distributed cell [{n}]>", line {raising}' in tb, tb
    except Exception:
        shot(page, "dashboard-failure.png")
        raise


#: every rank row's cells, read at once (the widget may redraw between two separate reads)
ROWS = """el => Object.fromEntries([...el.querySelectorAll(".nbdist-rows tr.nbdist-rank-row")]
  .map(tr => [tr.className, [...tr.children].map(td => td.textContent)]))"""


def positions(view) -> dict[int, tuple[str, int]]:
    """Each rank's bar as its row shows it: (the bar's name, its count)."""
    out = {}
    for cls, cells in view.locator(".nbdist-dashboard").evaluate(ROWS).items():
        if len(cells) > 2 and "/" in cells[2] and "nbdist-former" not in cls:
            rank = int(cls.split("nbdist-rank-")[2].split()[0])
            out[rank] = (cells[1].split(" · ")[0], int(cells[2].split("/")[0]))
    return out


def test_a_straggler_with_nested_tqdm_bars_names_the_bar_and_never_looks_ahead(nb):
    page, view = nb, out(nb, C_TQDM)
    try:
        run_cells(page, C_TQDM, C_TQDM)
        view.locator(".nbdist-dashboard").wait_for(timeout=120_000)
        header = view.locator(".nbdist-header")
        wait_for(lambda: "rank 1 is" in header.inner_text(), 60, "the straggler to be named")
        seen = 0
        deadline = time.monotonic() + 60
        while seen < 8 and time.monotonic() < deadline and not finished(page, C_TQDM):
            pos = positions(view)
            if len(pos) == 2 and pos[0][0] == pos[1][0] and pos[0][0].startswith("epoch "):
                # the same bar on both rows, read at one moment: in DDP neither is ahead
                assert abs(pos[0][1] - pos[1][1]) <= 2, pos
                seen += 1
            time.sleep(0.3)  # sampling the page while the ranks train
        assert seen >= 3, "rows never showed an inner bar by name"
        check_layout(view)
        doc_shot(view, "tqdm-straggler.png")
        wait_for(lambda: finished(page, C_TQDM), 120, "training to finish")
        assert "nbdist-straggler" in (view.locator(".nbdist-rank-1").first
                                      .get_attribute("class") or "")
    except Exception:
        shot(page, "tqdm-failure.png")
        raise


def test_a_rank_killed_and_replaced_keeps_its_history(nb, flag):
    page, view = nb, out(nb, C_KILL)
    try:
        run_cells(page, C_SETUP, C_SETUP)
        wait_for(lambda: finished(page, C_SETUP), 120, "the elastic set-up")
        run_cells(page, C_KILL, C_KILL)
        wait_for(flag.exists, 120, "rank 1 to kill itself")
        # the dead rank's row says so as soon as the notebook knows, the header says it once.
        # A replacement forked from the worker template can join before the next redraw:
        # then the first row that shows the death is already the former one.
        seen: list[tuple[str, str]] = []

        def died_row() -> str:
            now = (state_of(view, ".nbdist-rank-1"), state_of(view, ".nbdist-rank-1-former"))
            if not seen or seen[-1] != now:
                seen.append(now)
            return next((sel for sel, s in zip((".nbdist-rank-1", ".nbdist-rank-1-former"),
                                               now) if s.startswith("died: SIGKILL")), "")

        try:
            row = wait_for(died_row, 90, "rank 1's row to say it died")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; rank 1's rows read (current, former): {seen}") \
                from None
        # the header's last event: the death, or the re-formed group right after it (the
        # death is then the earlier event folded under it), or the replacement's joining
        # (the dashboard may redraw between reading the rows and reading the header)
        event = text(view.locator(".nbdist-last-event"))
        assert ("rank 1 on" in event or "re-formed without rank 1" in event
                or "replacement" in event), event
        events = view.locator(".nbdist-header").text_content()
        assert events.count("died: SIGKILL") == 1, events
        assert "running" in state_of(view, ".nbdist-rank-0")
        if row == ".nbdist-rank-1":
            doc_shot(view, "elastic-died.png")
        wait_for(lambda: finished(page, C_KILL), 240, "the elastic run to finish")
        header = view.locator(".nbdist-header").inner_text()
        # the job's 50 steps, not one worker's
        assert "finished in" in header and "50 steps" in header, header
        assert "a replacement worker joined" in header, header
        # history as it happened: every step on the chart, rules where it changed
        chart = view.locator(".nbdist-step-chart")
        chart.locator("img").wait_for(timeout=60_000)  # the static summary, labels and all
        labels = chart.locator(".nbdist-chart-label").all_text_contents()
        assert "step 0" in labels and "step 49" in labels, labels
        assert "rank 1 died" in labels and "replacement joined" in labels, labels
        # the dead worker and its replacement: two rows, numbers apart
        assert re.fullmatch(r"died: SIGKILL, last seen at line \d+ of In \[\d+\] · replaced",
                            state_of(view, ".nbdist-rank-1-former"))
        # what it reported before it died (the steps still in its buffer died with it)
        dead = row_text(view, ".nbdist-rank-1-former")
        assert re.search(r"\b([1-9]|10) steps\b", dead), dead
        # the replacement joins at the first commit after it is ready: at step 30 when rank 0
        # waits for it there, earlier when a worker forked from the template is ready sooner
        joined = re.fullmatch(r"done · joined at step (\d+)", state_of(view, ".nbdist-rank-1"))
        assert joined and 10 < int(joined[1]) <= 30, state_of(view, ".nbdist-rank-1")
        assert f"{50 - int(joined[1])} steps" in row_text(view, ".nbdist-rank-1")
        assert "50 steps" in row_text(view, ".nbdist-rank-0")
        # each event shown once: nothing printed beside the dashboard
        printed = out(page, C_KILL).locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stdout']")
        assert "nbdist.elastic" not in " ".join(printed.all_inner_texts())
        check_layout(view, one_line=False)
        doc_shot(view, "elastic-recovered.png")
    except Exception:
        shot(page, "elastic-failure.png")
        raise


def test_a_hang_keeps_time_and_a_timeout_blames_the_rank_that_held_the_others(nb):
    page, view = nb, out(nb, C_HANG)
    narrow = False
    try:
        run_cells(page, C_HANG, C_HANG)
        header = view.locator(".nbdist-header")
        # before the threshold (8 s), a quiet word that nothing moves
        wait_for(lambda: "no step for" in text(header), 60, "the quiet 'no step for N s'")
        assert not view.locator(".nbdist-stall").count()
        doc_shot(view, "hang-quiet.png")
        verdict = view.locator(".nbdist-stall")
        verdict.wait_for(timeout=30_000)
        v1, h1 = verdict.inner_text(), header.inner_text()
        assert "rank 0 waits in all_reduce" in v1 and "rank 1 never reached it" in v1, v1
        # the count where it stopped (the slowest rank's): about 20 of 1000, and it stays
        assert re.search(r"train (19|20|21)/1000 it", h1), h1
        doc_shot(view, "hang-verdict.png")
        # no event arrives now; the clock and the verdict's age move anyway
        wait_for(lambda: header.inner_text() != h1 and verdict.inner_text() != v1, 10,
                 "the clock to advance")
        assert "no step for" not in header.inner_text()
        wait_for(lambda: finished(page, C_HANG), 60, "the --timeout")
        head = header.inner_text()
        assert "stopped by --timeout 20 s after" in head, head
        assert state_of(view, ".nbdist-rank-0") == "stopped by --timeout · waiting in all_reduce"
        held = state_of(view, ".nbdist-rank-1")
        assert held.startswith("stopped by --timeout · held the others: in time.sleep(600)"), \
            held
        assert "nbdist-held" in (view.locator(".nbdist-rank-1").first.get_attribute("class")
                                 or "")
        dashboard = view.locator(".nbdist-dashboard").inner_text()
        assert "KeyboardInterrupt" not in dashboard, dashboard
        check_layout(view, one_line=False)  # the verdicts wrap
        doc_shot(view, "hang-timeout.png")
        # 1280 px with the file browser open (JupyterLab's default layout): the verdicts
        # still read, whole and on screen
        narrow = True
        page.set_viewport_size({"width": 1280, "height": 1000})
        browser_tab = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab[data-id='filebrowser']")
        if not page.locator(".jp-FileBrowser").is_visible():
            browser_tab.click()
        page.locator(".jp-FileBrowser").wait_for(state="visible")
        view.scroll_into_view_if_needed()
        lay = check_layout(view, one_line=False, fits=False)
        assert lay["windowWidth"] == 1280
        assert [r["state"] for r in lay["rows"]][0].startswith("stopped by --timeout")
        page.screenshot(path=str(SCREENSHOTS / "hang-timeout-1280.png"))
    except Exception:
        shot(page, "hang-failure.png")
        raise
    finally:
        if narrow:
            page.set_viewport_size(VIEWPORT)


def test_a_chatty_all_output_cell_keeps_to_its_box_and_shows_its_warning_again(nb):
    page, area = nb, out(nb, C_CHATTY)
    tabs = area.locator(".nbdist-rank-output")
    try:
        run_cells(page, C_CHATTY, C_CHATTY)
        merged = area.locator(".nbdist-output-merged")
        merged.locator("pre").wait_for(timeout=120_000)
        wait_for(lambda: "only rank 1" in merged.inner_text(), 60, "both ranks' last lines")
        wait_for(lambda: finished(page, C_CHATTY), 60, "the cell to finish")
        lines = merged.inner_text()
        assert "[0-1] step 0: loss 1.0000\n[0-1] checkpoint 0 written" in lines
        assert "[0] only rank 0" in lines and "[1] only rank 1" in lines
        # stderr lines are marked
        marked = merged.locator(".nbdist-stderr").all_inner_texts()
        assert marked[:1] == ["[0-1] checkpoint 0 written"], marked
        # the output scrolls in its own box, the latest line in view: the dashboard stays near
        box = merged.locator(".nbdist-output-box").evaluate(
            "b => ({h: b.getBoundingClientRect().height, sh: b.scrollHeight})")
        assert box["sh"] > box["h"] and box["h"] < 450, box
        top = area.bounding_box()["y"]
        dash = area.locator(".nbdist-dashboard").bounding_box()
        assert dash is not None and dash["y"] - top < 700, (top, dash)
        doc_shot(area, "chatty-all-output.png")
        assert tabs.locator(".lm-TabBar-tab").all_inner_texts() == ["all ranks", "rank 0",
                                                                    "rank 1"]
        tabs.locator(".lm-TabBar-tab").nth(2).click()
        rank1 = area.locator(".nbdist-output-rank-1")
        rank1.wait_for(state="visible")
        assert "only rank 1" in rank1.inner_text() and "[" not in rank1.inner_text()
        warned = area.locator(".nbdist-warnings").inner_text()
        assert "[0-1]" in warned and "this shard is small" in warned, warned
        # run again on the same warm workers: the warning shows again, as a plain kernel's
        run_again(page, C_CHATTY)
        wait_for(lambda: finished(page, C_CHATTY), 120, "the cell to run again")
        wait_for(lambda: "this shard is small" in text(area.locator(".nbdist-warnings")), 15,
                 "the warning on the re-run")
    except Exception:
        shot(page, "chatty-failure.png")
        raise


LUMINANCE = """el => {
  const [r, g, b] = getComputedStyle(el).color.match(/[0-9.]+/g).map(Number);
  return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255;
}"""


def test_charts_follow_the_dark_theme(nb):
    page, view = nb, out(nb, C_TRAIN)
    try:
        label = view.locator(".nbdist-step-chart .nbdist-chart-label").first
        assert label.evaluate(LUMINANCE) < 0.4  # dark text on the light theme
        command(page, "Use Theme: JupyterLab Dark")
        wait_for(lambda: page.locator("body[data-jp-theme-light='false']").count(), 30,
                 "the dark theme")
        wait_for(lambda: label.evaluate(LUMINANCE) > 0.6, 10, "the chart's text to turn light")
        legend = view.locator(".nbdist-legend").evaluate(
            "el => getComputedStyle(el).color")
        assert legend != "rgb(85, 85, 85)", legend  # not the light theme's fixed grey
        doc_shot(view, "dashboard-dark.png")
    except Exception:
        shot(page, "dark-failure.png")
        raise
    finally:
        command(page, "Use Theme: JupyterLab Light")


def test_cluster_panel_scales_follows_the_cluster_and_says_stopped(nb):
    page = nb
    panel = out(page, C_PANEL)
    rows = panel.locator(".nbdist-cluster-table tbody tr")
    box = panel.locator(".nbdist-cluster .widget-text input")
    try:
        run_cells(page, C_PANEL, C_PANEL)
        rows.first.wait_for(timeout=120_000)
        assert rows.count() == 2 and box.input_value() == "2"
        box.fill("3")
        box.press("Enter")
        panel.locator("button.nbdist-scale").click()
        wait_for(lambda: rows.count() == 3, 180, "the panel to show 3 workers")
        assert "re-formed" in panel.locator(".nbdist-cluster-message").inner_text()
        # it refreshes itself: the "updated" clock moves without a click
        note = panel.locator(".nbdist-cluster-note")
        before = note.inner_text()
        wait_for(lambda: note.inner_text() != before, 15, "the panel to refresh itself")
        doc_shot(panel, "cluster-panel.png")
        # scaled elsewhere, the panel's Scale box follows: one click must not undo it
        run_cells(page, C_SCALE, C_SCALE)
        wait_for(lambda: finished(page, C_SCALE), 120, "%nbdist scale 2")
        wait_for(lambda: rows.count() == 2 and box.input_value() == "2", 15,
                 "the Scale box to follow the cluster")
        run_cells(page, C_STOP, C_STOP)
        wait_for(lambda: finished(page, C_STOP), 60, "%nbdist stop to finish")
        assert "stopped 2 workers" in out(page, C_STOP).inner_text()
        table = panel.locator(".nbdist-cluster-table")
        wait_for(lambda: "stopped" in table.inner_text(), 15, "the panel to say stopped")
        assert "workers alive" not in table.inner_text() and "`" not in table.inner_text()
        doc_shot(panel, "cluster-panel-stopped.png")
    except Exception:
        shot(page, "cluster-failure.png")
        print("the panel's cell shows:", text(panel))
        raise


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
    try:
        wait_for(lambda: box.count() == 1, timeout, "an input box")
    except AssertionError as exc:  # what the cell showed instead, for the failure's report
        boxes = out.locator(".jp-OutputArea-stdin-item")
        hiding = out.locator(".jp-OutputArea-stdin-hiding")
        raise AssertionError(f"{exc}: {boxes.count()} input item(s), {hiding.count()} hiding, "
                             f"{box.count()} open; the output reads:\n"
                             f"{out.inner_text()[-3000:]}") from None
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
        run_cells(page, 0, 1)
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
