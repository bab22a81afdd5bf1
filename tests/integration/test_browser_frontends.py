"""The frontends users open, in a real browser (Debian's chromium through Playwright, with the
fixtures of test_browser.py): JupyterLab 4 on ipykernel 7 and on ipykernel 6, and Notebook 7.

In each: the live dashboard, the run's static summary once it ends, the cluster panel and
the debugger's prompt on rank 1 answered in the frontend's input box. Then the notebook the
user saved is reopened in a fresh session, trusted and untrusted, and exported with
``jupyter nbconvert --to html``: the run shows whole (its charts drawn, never "Error
displaying widget", no hover text spilled as prose).

The ipykernel 6 kernel runs in a virtual environment made once (``--system-site-packages`` and
``pip install "ipykernel<7"``) and kept under ``~/.cache/nbdist-tests/`` for later runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from test_browser import (  # noqa: F401 (browser: a fixture)
    NB,
    ROOT,
    STDIN,
    VIEWPORT,
    answer,
    browser,
    finished,
    jupyter_server,
    notebook,
    out,
    run_cells,
    shot,
    wait_for,
)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

CACHE = Path.home() / ".cache" / "nbdist-tests" / "ipykernel6-venv"
KERNEL6 = "nbdist-ipykernel6"

TRAIN = """%%distributed
import time, torch, nbdist
from torch.nn.parallel import DistributedDataParallel as DDP
ddp = DDP(torch.nn.Linear(16, 4))
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
for i in nbdist.progress(range(40), desc="train"):
    time.sleep(0.1)
    loss = ddp(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    nbdist.log(loss=loss)
"""
BREAKPOINT = """%%distributed
import torch, torch.distributed as dist
x = torch.tensor([float(rank + 1)])
if rank == 1:
    breakpoint()
dist.all_reduce(x)
x.item()
"""
CELLS = ["import ipykernel\n%load_ext nbdist\n%nbdist start -n 2\nipykernel.__version__",
         TRAIN, "%nbdist cluster", BREAKPOINT, "%nbdist stop"]
C_START, C_TRAIN, C_PANEL, C_DEBUG, C_STOP = range(len(CELLS))

#: (app, kernel name, the kernel's ipykernel major version)
FRONTENDS = {"lab-ipykernel7": ("lab", "python3", "7"),
             "lab-ipykernel6": ("lab", KERNEL6, "6"),
             "notebook7-ipykernel7": ("notebook", "python3", "7")}
#: each frontend's notebook as the user saved it, for the reopening tests
SAVED: dict[str, Path] = {}


def ipykernel6_python() -> Path:
    """The cached virtual environment's Python, where ``ipykernel<7`` is installed."""
    python = CACHE / "bin" / "python"
    check = [str(python), "-c", "import ipykernel, sys; "
             "sys.exit(ipykernel.__version__.split('.')[0] != '6')"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    shutil.rmtree(CACHE, ignore_errors=True)
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(CACHE)],
                   check=True, timeout=300)
    made = subprocess.run([str(python), "-m", "pip", "install", "-q", "ipykernel<7"],
                          capture_output=True, text=True, timeout=600)
    if made.returncode != 0 or subprocess.run(check).returncode != 0:
        shutil.rmtree(CACHE, ignore_errors=True)
        pytest.skip(f"could not install ipykernel<7 in a virtual environment: {made.stderr}")
    return python


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for every frontend: JupyterLab and Notebook 7 (where installed), with a
    kernelspec for the ipykernel 6 environment in its data folder."""
    root = tmp_path_factory.mktemp("frontends")
    data = root / ".data"
    spec = data / "kernels" / KERNEL6
    spec.mkdir(parents=True)
    spec.joinpath("kernel.json").write_text(json.dumps({
        "argv": [str(ipykernel6_python()), "-m", "ipykernel_launcher", "-f",
                 "{connection_file}"],
        "display_name": "Python 3 (ipykernel 6)", "language": "python"}))
    # an IPython folder of its own: ipyparallel's server extension polls every cluster file
    # in it on the server's event loop, and ~/.ipython may hold many stale ones
    with jupyter_server(root, JUPYTER_DATA_DIR=str(data),
                        IPYTHONDIR=str(root / ".ipython")) as served:
        yield served


def url(server: dict, app: str, name: str) -> str:
    if app == "lab":  # a workspace of its own: nothing an earlier test left open is restored
        return (f"{server['base']}/lab/workspaces/{Path(name).stem}/tree/{name}"
                f"?reset&token={server['token']}")
    return f"{server['base']}/notebooks/{name}?token={server['token']}"


def open_page(browser, server: dict, app: str, name: str, cells: int):  # noqa: F811
    page = browser.new_page(viewport=VIEWPORT)
    page.set_default_timeout(60_000)
    page.goto(url(server, app, name))
    wait_for(lambda: page.locator(f"{NB} .jp-Cell .jp-InputPrompt").count() == cells
             and all(p.strip() for p in page.locator(
                 f"{NB} .jp-Cell .jp-InputPrompt").all_inner_texts()),
             90, "every cell to render")
    return page


def kernel_state(server: dict, name: str) -> str:
    """The execution state of the kernel of the notebook ``name`` ("" while it has none)."""
    with urllib.request.urlopen(f"{server['base']}/api/sessions?token={server['token']}",
                                timeout=5) as r:
        sessions = json.load(r)
    return next((s["kernel"]["execution_state"] for s in sessions
                 if s.get("path") == name and s.get("kernel")), "")


def trusted_cells(server: dict, name: str) -> list[bool]:
    """What the server says of each code cell's trust (it signs what it saves)."""
    with urllib.request.urlopen(f"{server['base']}/api/contents/{name}?content=1&token="
                                f"{server['token']}", timeout=10) as r:
        model = json.load(r)
    return [c["metadata"].get("trusted", False) for c in model["content"]["cells"]
            if c["cell_type"] == "code"]


def images_drawn(area) -> list[dict]:
    return area.evaluate("a => [...a.querySelectorAll('.nbdist-summary img')].map(i => "
                         "({ok: i.complete && i.naturalWidth > 0, w: i.naturalWidth}))")


def check_saved_run(area) -> None:
    """The run's output as a saved notebook must show it: summary, charts, no error."""
    shown = area.inner_text()
    assert "Error displaying widget" not in shown, shown
    assert "finished in" in shown and "train 40/40 it" in shown, shown
    # the SVG's hover text, once spilled as prose by sanitizers
    assert "that ran it" not in shown and "exposed communication, split" not in shown, shown
    wait_for(lambda: (lambda imgs: len(imgs) >= 3 and all(i["ok"] for i in imgs))(
        images_drawn(area)), 30, "the charts' images to load")


@pytest.mark.parametrize("frontend", list(FRONTENDS))
def test_dashboard_panel_and_debugger_in_each_frontend(browser, server, frontend):  # noqa: F811
    app, kernel, major = FRONTENDS[frontend]
    if app == "notebook" and shutil.which("jupyter-notebook") is None:
        pytest.skip("Notebook 7 is not installed (pip install notebook)")
    name = f"{frontend}.ipynb"
    nb = notebook(CELLS)
    nb["metadata"]["kernelspec"]["name"] = kernel
    (server["root"] / name).write_text(json.dumps(nb))
    page = open_page(browser, server, app, name, len(CELLS))
    try:
        run_cells(page, C_START, C_START)
        wait_for(lambda: finished(page, C_START), 240, "the cluster to start")
        started = out(page, C_START).inner_text()
        assert "2 of 2 workers ready" in started and f"'{major}." in started, started
        # the live dashboard, then its static summary in the same place
        run_cells(page, C_TRAIN, C_TRAIN)
        view = out(page, C_TRAIN)
        header = view.locator(".nbdist-dashboard .nbdist-header")
        wait_for(lambda: "running for" in (header.first.inner_text() if header.count()
                                           else ""), 120, "the live dashboard")
        assert view.locator(".widget-box.nbdist-dashboard").count() == 1
        wait_for(lambda: finished(page, C_TRAIN), 120, "training to finish")
        wait_for(lambda: view.locator(".nbdist-summary").count() == 1, 30,
                 "the static summary to take the widget's place")
        assert view.locator(".widget-box.nbdist-dashboard").count() == 0
        check_saved_run(view)
        # the cluster panel: a row per worker, refreshed by itself
        run_cells(page, C_PANEL, C_PANEL)
        rows = out(page, C_PANEL).locator(".nbdist-cluster-table tbody tr")
        rows.first.wait_for(timeout=60_000)
        assert rows.count() == 2
        # the debugger's prompt on rank 1, answered in the frontend's input box
        run_cells(page, C_DEBUG, C_DEBUG)
        debug = out(page, C_DEBUG)
        wait_for(lambda: debug.locator(f"{STDIN} .jp-Stdin-input:not([readonly])").count(),
                 120, "rank 1's pdb prompt")
        answer(debug, "c")
        wait_for(lambda: finished(page, C_DEBUG), 120, "the cell to go on after 'c'")
        assert "3.0" in debug.inner_text(), debug.inner_text()
        run_cells(page, C_STOP, C_STOP)
        wait_for(lambda: finished(page, C_STOP), 120, "%nbdist stop")
        # saved as the user saves it
        page.keyboard.press("Escape")
        page.keyboard.press("Control+s")
        path = server["root"] / name
        wait_for(lambda: "nbdist-summary" in path.read_text(), 30, "the notebook to be saved")
        saved = json.loads(path.read_text())
        outputs = saved["cells"][C_TRAIN]["outputs"]
        kinds = {k for o in outputs for k in o.get("data", {})}
        assert "application/vnd.jupyter.widget-view+json" not in kinds, kinds
        html = "".join("".join(o["data"]["text/html"]) for o in outputs  # str, or lines
                       if "text/html" in o.get("data", {}))
        assert "<svg" not in html and html.count("data:image/png;base64,") >= 3
        SAVED[frontend] = path
    except Exception:
        shot(page, f"frontend-{frontend}-failure.png")
        raise
    finally:
        page.close()


@pytest.mark.parametrize("trusted", [True, False], ids=["trusted", "untrusted"])
@pytest.mark.parametrize("frontend", list(FRONTENDS))
def test_a_saved_notebook_reopened_in_a_fresh_session_shows_the_run_whole(
        browser, server, frontend, trusted):  # noqa: F811
    if frontend not in SAVED:
        pytest.skip(f"no notebook saved from {frontend} (its own test did not finish)")
    app = FRONTENDS[frontend][0]
    name = f"{frontend}-{'trusted' if trusted else 'untrusted'}.ipynb"
    saved = json.loads(SAVED[frontend].read_text())
    if trusted:  # the same bytes: the server's signature of what it saved still holds
        shutil.copyfile(SAVED[frontend], server["root"] / name)
    else:  # as received from someone else: no signature matches it
        saved["metadata"]["nbdist_test"] = "received"
        (server["root"] / name).write_text(json.dumps(saved))
    assert all(trusted_cells(server, name)) is trusted
    page = open_page(browser, server, app, name, len(CELLS))
    area = out(page, C_TRAIN)
    try:
        # the fresh kernel's widget manager has restored (it says "model not found" then)
        wait_for(lambda: kernel_state(server, name) == "idle", 120, "the fresh kernel")
        wait_for(lambda: area.locator(".nbdist-summary").count()
                 or "Error displaying widget" in area.inner_text(), 60, "the saved output")
        check_saved_run(area)
        if not trusted:
            assert not area.locator(".nbdist-summary :is(script, svg)").count()
    except Exception:
        shot(page, f"reopen-{name}.png")
        raise
    finally:
        page.close()


def test_nbconvert_html_of_the_saved_notebook_draws_the_run(browser, server,  # noqa: F811
                                                         tmp_path):
    if not SAVED:
        pytest.skip("no notebook was saved (the frontends' tests did not finish)")
    source = next(iter(SAVED.values()))
    subprocess.run([sys.executable, "-m", "nbconvert", "--to", "html", str(source),
                    "--output-dir", str(tmp_path)], check=True, timeout=120,
                   cwd=ROOT, capture_output=True)
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.goto((tmp_path / source.with_suffix(".html").name).as_uri())
        area = page.locator(".jp-OutputArea", has=page.locator(".nbdist-summary")).first
        area.wait_for()
        check_saved_run(area)
    finally:
        page.close()
