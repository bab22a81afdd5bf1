"""Auto mode: the input transformer's rules, and the magics in an IPython shell on a scripted
session (which cells go to the ranks, which stay, the indicator, off, stop)."""

from __future__ import annotations

import pytest
from fakes import ScriptedBackend

pytest.importorskip("IPython")

from IPython.core.error import UsageError  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

import nbdist  # noqa: E402
from nbdist import session as session_mod  # noqa: E402
from nbdist.magics import automode as auto  # noqa: E402
from nbdist.session import Session  # noqa: E402


def lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


@pytest.mark.parametrize("cell,sent", [
    ("x = 1\n", True),
    ("# set-up\n\nimport torch\n", True),
    ("%nbdist status\n", False),
    ("# a comment first\n%nbdist push lr\n", False),
    ("%%time\nx = 1\n", False),
    ("%%distributed --all-output\nx = 1\n", False),  # already a cell magic: left as written
    ("!nvidia-smi\n", False),
    ("torch.nn.Linear?\n", False),
    ("x = a ? b\ny = 2\n", True),  # not a one-line help request
    ("\n# only a comment\n", False),
])
def test_which_cells_go_to_the_ranks(cell, sent):
    t = auto.AutoMode()
    t.enabled = True
    out = t(lines(cell))
    assert (out[0] == "%%distributed\n") is sent
    if sent:
        assert "".join(out[1:]) == cell  # the cell itself is untouched: line numbers match
    t.enabled = False
    assert t(lines(cell)) == lines(cell)


def test_local_cells_run_as_written_with_their_line_numbers():
    t = auto.AutoMode()
    for enabled in (True, False):
        t.enabled = enabled
        assert t(lines("%%local\nx = 1\ny = 2\n")) == ["\n", "x = 1\n", "y = 2\n"]
        assert t(lines("%%local\n%%time\nx = 1\n")) == ["%%time\n", "x = 1\n"]
    assert "SyntaxError" in t(lines("%%local --ranks 0\nx = 1\n"))[0]
    assert t(lines("%%localize\nx\n")) == lines("%%localize\nx\n")  # another magic's name


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend(2)


@pytest.fixture
def shell(backend, monkeypatch):
    session = Session(backends=lambda engine: backend, stores=None).start(2, timeout=5)
    monkeypatch.setattr(session_mod, "_default", session)
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "nbdist")
    sh.run_line_magic("load_ext", "nbdist")  # loading twice installs one transformer
    assert sum(isinstance(t, auto.AutoMode) for t in sh.input_transformers_cleanup) == 1
    try:
        yield sh
    finally:
        auto.set_auto(sh, False)
        sh.user_ns.pop("here", None)


def cells_run(backend: ScriptedBackend) -> int:
    return backend.calls.count("run_cell") // 2  # one call per rank


def test_auto_on_sends_plain_cells_to_the_ranks_and_keeps_magics_here(shell, backend, capsys):
    shell.run_line_magic("nbdist", "auto on")
    assert "auto mode on" in capsys.readouterr().out
    assert shell.run_cell("here = 1").success
    assert cells_run(backend) == 1 and "here" not in shell.user_ns
    assert "nbdist auto: this cell runs on ranks 0-1" in capsys.readouterr().out
    assert shell.run_cell("%nbdist auto").success  # a magic: runs in the kernel
    assert "auto mode is on" in capsys.readouterr().out
    assert shell.run_cell("%%local\nhere = 2\nhere * 10").result == 20
    assert shell.user_ns["here"] == 2 and cells_run(backend) == 1
    nbdist.auto(False)  # the Python twin
    assert "auto mode off" in capsys.readouterr().out
    assert shell.run_cell("here = 3").success and shell.user_ns["here"] == 3
    assert cells_run(backend) == 1


def test_stop_turns_auto_mode_off_and_on_needs_a_cluster(shell, backend, capsys):
    nbdist.auto(True)
    shell.run_line_magic("nbdist", "stop")
    assert "auto mode off" in capsys.readouterr().out and not auto.is_on(shell)
    assert shell.run_cell("here = 4").success and shell.user_ns["here"] == 4
    with pytest.raises(UsageError, match="nbdist start"):
        shell.run_line_magic("nbdist", "auto on")
    with pytest.raises(UsageError, match="invalid choice"):
        shell.run_line_magic("nbdist", "auto maybe")


def test_a_cell_sent_by_auto_mode_without_cluster_says_how_to_get_back(shell, backend):
    auto.set_auto(shell, True)
    session_mod._default.stop()  # the cluster went away without %nbdist stop
    result = shell.run_cell("here = 5")
    assert isinstance(result.error_in_exec, UsageError)
    assert "%nbdist auto off" in str(result.error_in_exec)


def test_local_magic_called_directly_runs_here_and_raises_errors(shell):
    shell.run_cell_magic("local", "", "here = 6")
    assert shell.user_ns["here"] == 6
    with pytest.raises(ZeroDivisionError):
        shell.run_cell_magic("local", "", "1 / 0")
    with pytest.raises(UsageError, match="no options"):
        shell.run_cell_magic("local", "--now", "here = 7")


def test_the_python_twin_refuses_to_run_on_a_rank(monkeypatch):
    import types

    fake = types.SimpleNamespace(current=lambda: types.SimpleNamespace(plan=object()))
    monkeypatch.setitem(__import__("sys").modules, "nbdist.runtime.worker", fake)
    with pytest.raises(RuntimeError, match="%nbdist auto off"):
        nbdist.auto(False)
