"""Auto mode, tqdm bars, per-rank output and warnings, in a real kernel on 2 real workers.

One notebook runs once through nbclient (one cluster for the module); each test reads the cells
it is about from the saved notebook.
"""

from __future__ import annotations

import json

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.timeout(300)

CELLS = {
    "start": "%load_ext nbdist\n%nbdist start -n 2",
    "auto_on": "%nbdist auto on",
    "plain": ("import torch, torch.distributed as dist\n"
              "t = torch.tensor([rank + 1])\n"
              "dist.all_reduce(t)\n"
              "print(f'rank {rank} of {world_size} sees {t.item()}')\n"
              "t.item()"),
    "magic": "%nbdist status",
    "local": "%%local\nimport os\nkernel_pid = os.getpid()\n'rank' in globals()",
    "tqdm": ("import time\n"
             "from tqdm.auto import tqdm\n"
             "for i in tqdm(range(40), desc='tqdm loop'):\n"
             "    time.sleep(0.005)"),
    "tqdm_events": ("%%local\n"
                    "import json, nbdist\n"
                    "run = nbdist.current_session().runs[-1]\n"
                    "bars = {r: [e for e in evs if e['kind'] == 'progress']\n"
                    "        for r, evs in run.events().items()}\n"
                    "print(json.dumps({r: [[e['desc'], e['n'], e['total'], e['done']]\n"
                    "                      for e in b] for r, b in bars.items()}))"),
    "all_output": ("%%distributed --all-output\n"
                   "for e in range(2):\n"
                   "    print(f'epoch {e} done')\n"
                   "print(f'only rank {rank}')"),
    "warn": "import warnings\nwarnings.warn('lr is high')\nx = 1",
    "auto_off": "%nbdist auto off",
    "after_off": "rank",
    "stop": "%nbdist stop",
}


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    cells = []
    for name, src in CELLS.items():
        cell = nbformat.v4.new_code_cell(src, metadata={"name": name})
        if name == "after_off":
            cell.metadata["tags"] = ["raises-exception"]
        cells.append(cell)
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    path = tmp_path_factory.mktemp("habits") / "habits.ipynb"
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    nbformat.write(nb, path)
    return {c.metadata["name"]: c for c in nb.cells}, path.read_text()


def texts(cell) -> str:
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}")
    return "\n".join(parts)


def test_auto_mode_runs_a_plain_cell_on_both_ranks(executed):
    cells, _ = executed
    out = texts(cells["plain"])
    assert "nbdist auto: this cell runs on ranks 0-1" in out  # the indicator
    assert "[0] rank 0 of 2 sees 3" in out  # 1 + 2: the all-reduce had both ranks
    [result] = [o for o in cells["plain"].outputs if o.output_type == "execute_result"]
    assert result.data["text/plain"] == "3"


def test_magics_and_local_cells_stay_in_the_kernel(executed):
    cells, _ = executed
    assert "2/2 workers alive" in texts(cells["magic"])
    assert "nbdist auto:" not in texts(cells["magic"])
    [result] = [o for o in cells["local"].outputs if o.output_type == "execute_result"]
    assert result.data["text/plain"] == "False"  # the kernel has no `rank`


def test_auto_off_runs_cells_in_the_kernel_again(executed):
    cells, _ = executed
    assert "auto mode off" in texts(cells["auto_off"])
    [err] = [o for o in cells["after_off"].outputs if o.output_type == "error"]
    assert err.ename == "NameError"


def test_a_tqdm_loop_is_a_bar_per_rank_not_carriage_returns(executed):
    cells, saved = executed
    bars = json.loads(texts(cells["tqdm_events"]).strip().splitlines()[-1])
    assert set(bars) == {"0", "1"}
    for events in bars.values():
        assert {desc for desc, *_ in events} == {"tqdm loop"}
        assert events[-1] == ["tqdm loop", 40, 40, True]
        assert len(events) >= 2  # it moved while it ran, not only at the end
    assert "\r" not in texts(cells["tqdm"])
    assert "\\r" not in saved  # nowhere in the saved notebook
    assert "it/s" not in texts(cells["tqdm"])  # tqdm's own text line never reached the cell


def test_all_output_is_merged_with_folded_lines_and_viewable_per_rank(executed):
    cells, _ = executed
    [shown] = [o for o in cells["all_output"].outputs
               if o.output_type == "display_data" and "nbdist-rank-output-static"
               in o.data.get("text/html", "")]
    assert shown.data["text/plain"].splitlines() == [
        "[0-1] epoch 0 done", "[0-1] epoch 1 done", "[0] only rank 0", "[1] only rank 1"]
    assert "application/vnd.jupyter.widget-view+json" in shown.data
    html = shown.data["text/html"]
    assert "<summary>rank 0</summary>" in html and "<summary>rank 1</summary>" in html


def test_a_warning_from_both_ranks_is_shown_once_naming_them(executed):
    cells, _ = executed
    warned = [o for o in cells["warn"].outputs if o.output_type == "display_data"
              and "nbdist-warnings" in o.data.get("text/html", "")]
    assert len(warned) == 1
    [line] = warned[0].data["text/plain"].splitlines()
    assert line.startswith("[0-1] <distributed cell ") and line.endswith(
        ":2: UserWarning: lr is high")
    assert "lr is high" not in "".join(o.get("text", "") for o in cells["warn"].outputs)
