"""rich's output on a rank reads in the cell as it reads in a torchrun log: clean text.

A Jupyter kernel sets ``FORCE_COLOR=1``, ``CLICOLOR_FORCE=1`` and ``TERM=xterm-color`` for its
own display (ipykernel's ``init_environment``; an ipyparallel engine, a kernel itself, sets
them again), and rich draws live, coloured terminal frames wherever ``FORCE_COLOR`` is set. A
cluster started from such a kernel must still give a rank rich's non-terminal behaviour, as a
torchrun rank writing to a file has: no ANSI escape sequences, each progress bar once, as its
final line. Checked on both engines with Lightning's ``RichProgressBar``, Lightning's default
progress bar (rich's when rich is installed), ``rich.progress.track`` and ``rich.print``
markup, against the same code under ``torchrun --nproc_per_node=2`` with its output in a file.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import Counter

import pytest
from clusters import ENGINES, start_session

pytest.importorskip("rich")
pytest.importorskip("lightning")
zmqshell = pytest.importorskip("ipykernel.zmqshell")

pytestmark = pytest.mark.timeout(600)

ESCAPE = "\x1b["

CODE = r'''
import time

import rich
import torch
import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from rich.progress import track


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, i):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(**kw):
    g = torch.Generator().manual_seed(1)
    xy = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g),
                                        torch.randn(32, 1, generator=g))
    trainer = L.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_epochs=2,
                        logger=False, enable_checkpointing=False, **kw)
    trainer.fit(Regression(), torch.utils.data.DataLoader(xy, batch_size=4))


def bars():
    fit(callbacks=[RichProgressBar()])
    fit()  # Lightning's default bar: rich's, where rich is installed


def plain():
    for _ in track(range(10), description="working"):
        time.sleep(0.01)
    rich.print("[bold]done[/bold] [red]here[/red]")
'''

MAIN = '''
if __name__ == "__main__":
    bars()
    plain()
'''


def kernel_env() -> dict[str, str]:
    """The variables ipykernel sets in a kernel's environment for its own display (its own
    code, applied to a copy of this process's environment)."""
    saved = dict(os.environ)
    try:
        zmqshell.ZMQInteractiveShell.init_environment(None)
        return {k: v for k, v in os.environ.items() if saved.get(k) != v}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def lines_of(text: str, *starts: str) -> Counter:
    """The lines of ``text`` that start with one of ``starts`` once a rank's prefix is gone,
    each with its count, numbers as ``#`` (times, rates and losses differ from run to run) and
    a bar as one ``━`` (its width takes what the numbers leave of the line)."""
    lines = (re.sub(r"^\[\d+\] ", "", line).rstrip() for line in text.splitlines())
    return Counter(re.sub(r"\d+", "#", re.sub("━+", "━", line)) for line in lines
                   if line.startswith(starts))


@pytest.fixture(scope="module")
def under_torchrun(tmp_path_factory) -> str:
    """What torchrun's log files get from the code, started from a terminal's environment
    (without the kernel's variables): each rank's output in a file of its own (``--redirects
    3``), read one after the other. Two ranks writing one shared file can interleave inside a
    line (rich writes a line's text and its newline apart)."""
    tmp = tmp_path_factory.mktemp("rich")
    (tmp / "train.py").write_text(CODE + MAIN)
    env = {k: v for k, v in os.environ.items() if k not in kernel_env()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--log-dir", str(tmp / "ranks"), "--redirects", "3", "train.py"]
    with open(tmp / "log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail("torchrun did not finish within 300 s")
    text = (tmp / "log").read_text()
    assert proc.returncode == 0, text[-3000:]
    logs = sorted((tmp / "ranks").rglob("*.log"))
    assert len(logs) == 4, (logs, text[-3000:])  # stdout and stderr of each rank
    return text + "".join(f.read_text() for f in logs)


@pytest.fixture(scope="module", params=ENGINES)
def session(request):
    """A cluster started from a kernel's environment, as a notebook starts it."""
    saved = dict(os.environ)
    os.environ.update(kernel_env())
    try:
        s = start_session(request.param, 2)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        s.run_cell(CODE, output="quiet", timeout=300)  # imports and definitions
        yield s
    finally:
        s.stop()


def cell_output(session, capsys, code: str) -> str:
    capsys.readouterr()
    session.run_cell(code, output="all", timeout=300)
    out, err = capsys.readouterr()
    return out + err


def test_the_kernel_sets_what_makes_rich_draw_terminal_frames():
    # the ground truth this module stands on: a kernel's environment forces rich's terminal
    from rich.console import Console

    saved = dict(os.environ)
    os.environ.update(kernel_env())
    try:
        assert Console(file=open(os.devnull, "w")).is_terminal
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_lightnings_rich_bars_read_as_torchruns_log(session, under_torchrun, capsys):
    assert ESCAPE not in under_torchrun
    out = cell_output(session, capsys, "bars()")
    assert ESCAPE not in out, repr(out[:2000])
    want, got = lines_of(under_torchrun, "Epoch"), lines_of(out, "Epoch")
    assert sum(want.values()) == 2, want  # rank 0 draws each fit's bar, once, its last frame
    assert got == want


def test_rich_track_and_print_read_as_torchruns_log(session, under_torchrun, capsys):
    out = cell_output(session, capsys, "plain()")
    assert ESCAPE not in out, repr(out[:2000])
    want = lines_of(under_torchrun, "working", "done")
    assert want == {"working ━ #% #:#:#": 2, "done here": 2}, want
    assert lines_of(out, "working", "done") == want  # every rank's, as in torchrun's log


def test_a_coloured_tqdm_bar_is_the_ranks_bar_not_coloured_frames(session, capsys):
    # torchrun's log gets tqdm's coloured frames on stderr; a cell shows the bar on the
    # dashboard instead, as every tqdm bar on a rank
    out = cell_output(session, capsys, "from tqdm import tqdm\n"
                                       "for _ in tqdm(range(10), colour='green'):\n    pass\n")
    assert ESCAPE not in out, repr(out[:2000])
    run = session.last_run
    assert run is not None
    assert [(r.bar.n, r.bar.total) for r in run.ranks] == [(10, 10)] * 2
