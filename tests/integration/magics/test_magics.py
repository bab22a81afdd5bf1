"""The magics in a real IPython shell: usage errors, delegation to the session, results."""

from __future__ import annotations

import textwrap

import psutil
import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import nbdist.session as session_mod
from nbdist.errors import DistributedError, ExportError
from nbdist.options import CellDefaults
from nbdist.records import ClusterStatus
from nbdist.session import Session

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def shell():
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "nbdist")
    sh.run_line_magic("load_ext", "nbdist")  # loading twice is harmless
    return sh


@pytest.fixture
def no_cluster(monkeypatch):
    monkeypatch.setattr(session_mod, "_default", Session())


@pytest.fixture
def with_cluster(cluster, monkeypatch):
    monkeypatch.setattr(session_mod, "_default", cluster)  # the magics use this session
    return cluster


@pytest.mark.parametrize("line,message", [
    ("", "VERB"),
    ("bogus", "invalid choice"),
    ("start -n 0", "-n must be at least 1"),
    ("start -n two", "invalid int value"),
    ("start --engine spark", "invalid choice"),
    ("start --device cpu --dist-backend nccl", "needs --device cuda"),
    ("start --timeout -1", "must be positive"),
    ("pull", "required"),
    ("run", "required"),
    ("start 'unbalanced", "quotation"),
    ("connect --engine dask tls://127.0.0.1:1 --tls-cert c.pem", "needs --tls-ca-file"),
    ("connect --profile x --tls-ca-file a.pem --tls-cert c.pem", "for --engine dask"),
    ("connect --engine dask tls://127.0.0.1:1 --tls-ca-file /no/ca.pem --tls-cert /no/c.pem",
     "no such file: /no/ca.pem, /no/c.pem"),
])
def test_bad_arguments_are_usage_errors(shell, no_cluster, line, message):
    with pytest.raises(UsageError, match=message):
        shell.run_line_magic("nbdist", line)


def test_cell_without_a_cluster_says_how_to_start_one(shell, no_cluster):
    with pytest.raises(UsageError, match="%nbdist start"):
        shell.run_cell_magic("distributed", "", "x = 1")
    with pytest.raises(Exception, match="nbdist start"):
        shell.run_line_magic("nbdist", "status")


def test_help_is_complete():
    from nbdist.magics import NbdistMagics

    doc = NbdistMagics.nbdist.__doc__
    for verb in ("start", "connect", "status", "stop", "restart", "scale", "push", "pull",
                 "cluster", "timeline", "run", "profile", "export", "auto"):
        assert f"%nbdist {verb}" in doc
    assert "%%nbdist" not in doc
    assert "--ranks" in NbdistMagics.distributed.__doc__


def test_run_cell_through_the_shell_raises_for_run_all(shell, with_cluster):
    result = shell.run_cell("%%distributed --quiet\nif rank == 1:\n    1 / 0\n")
    assert isinstance(result.error_in_exec, DistributedError)
    assert result.error_in_exec.ranks == [1]
    result = shell.run_cell("%%distributed --quiet\nrank + 40")
    assert result.success and repr(result.result) == "40"


def test_traceback_names_the_editor_line_and_the_cell_number(shell, with_cluster):
    cell = "%%distributed --quiet\nx = 1\n\nif rank == 1:\n    raise ValueError('bad shard')\n"
    raising = next(i for i, line in enumerate(cell.splitlines(), 1) if "raise" in line)
    count = shell.execution_count  # what the prompt shows for this cell: In [count]
    result = shell.run_cell(cell, store_history=True)
    err = result.error_in_exec
    assert isinstance(err, DistributedError) and err.causes[0].line == raising == 5
    text = "\n".join(err._render_traceback_())
    assert "rank 1 on " in text and f"(In [{count}], line {raising})" in text
    assert f'File "<distributed cell [{count}]>", line {raising}' in text
    assert "raise ValueError('bad shard')" in text  # the editor's line, shown under it


def test_stop_says_there_was_nothing_to_stop(shell, no_cluster, capsys):
    shell.run_line_magic("nbdist", "stop")
    assert "no cluster was running" in capsys.readouterr().out


def test_cell_usage_errors(shell, with_cluster):
    with pytest.raises(UsageError, match="out of range"):
        shell.run_cell_magic("distributed", "--ranks 7", "x = 1")
    with pytest.raises(UsageError, match="not both"):
        shell.run_cell_magic("distributed", "--quiet --all-output", "x = 1")
    with pytest.raises(UsageError, match="positive"):
        shell.run_cell_magic("distributed", "--timeout 0", "x = 1")


def test_push_and_pull_magics(shell, with_cluster):
    shell.user_ns["lr"] = 0.25
    shell.user_ns["steps"] = 3
    shell.run_line_magic("nbdist", "push lr steps")
    shell.run_cell_magic("distributed", "--quiet", textwrap.dedent("""
        import types, torch
        box = types.SimpleNamespace(w=torch.full((2,), lr * steps + rank))
    """))
    shell.run_line_magic("nbdist", "pull box.w --rank 1 --as w1")
    assert shell.user_ns["w1"].tolist() == [1.75, 1.75]
    shell.run_line_magic("nbdist", "pull box")
    assert shell.user_ns["box"].w.tolist() == [0.75, 0.75]
    with pytest.raises(UsageError, match="not defined in the notebook"):
        shell.run_line_magic("nbdist", "push no_such_variable")


def test_status_magic(shell, with_cluster):
    status = shell.run_line_magic("nbdist", "status")
    assert isinstance(status, ClusterStatus)
    assert [r.rank for r in status.rows] == [0, 1] and all(r.alive for r in status.rows)
    assert "2/2 workers alive" in repr(status) and "<table " in status._repr_html_()


def test_rerunning_the_start_cell_keeps_the_warm_workers(shell, with_cluster, capsys):
    before = [r.pid for r in with_cluster.status().rows]
    shell.run_cell("%%distributed --quiet\nwarm = rank + 1\n")
    capsys.readouterr()
    engine = with_cluster.backend.name
    status = shell.run_line_magic("nbdist", f"start -n 2 --engine {engine} --timeout 60")
    out = capsys.readouterr().out
    assert out.startswith("nbdist: already running with these options: kept its 2 workers")
    assert out.count("\n") == 1 and "%nbdist restart" in out
    assert [r.pid for r in status.rows] == before  # the same processes
    assert repr(with_cluster.run_cell("warm", ranks="1")) == "2"  # their namespaces too


@pytest.mark.parametrize("text,message", [
    (None, r"p\.yaml: no such file"),
    ("cluster:\n  engine: dask\n  wrokers: 2\n",
     r"p\.yaml, line 3: cluster\.wrokers: unknown key; did you mean 'workers'\?"),
    ("runtime:\n  threads: two\n", r"p\.yaml, line 2: runtime\.threads: Input should be a "
                                    "valid integer"),
])
def test_bad_profiles_are_one_usage_error_and_start_nothing(shell, no_cluster, tmp_path, text,
                                                            message):
    path = tmp_path / "p.yaml"
    if text is not None:
        path.write_text(text)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(UsageError, match=message) as info:
        shell.run_line_magic("nbdist", f"start --profile {path} -n 2")
    assert str(info.value).startswith("%nbdist start: bad profile ")
    assert str(info.value).endswith("Nothing was started.")
    assert not session_mod.default_session().running
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before


def test_profile_check(shell, no_cluster, tmp_path, capsys):
    path = tmp_path / "ok.yaml"
    path.write_text("cluster:\n  workers: 3\n")
    shell.run_line_magic("nbdist", f"profile check {path}")
    out = capsys.readouterr().out
    assert f"{path}: valid" in out and "workers: 3" in out
    with pytest.raises(UsageError, match="invalid choice"):
        shell.run_line_magic("nbdist", f"profile load {path}")


def test_export_and_profile_save_magics(shell, with_cluster, tmp_cwd, capsys):
    with_cluster.history.reset()  # as if the group had just formed
    with pytest.raises(ExportError, match="nothing to export"):
        shell.run_line_magic("nbdist", "export train.py")
    shell.run_cell_magic("distributed", "--quiet", "exported_value = rank + 1")
    shell.run_line_magic("nbdist", "export train.py")
    assert "Launch: torchrun --nproc_per_node=2 train.py" in capsys.readouterr().out
    assert "exported_value = rank + 1" in (tmp_cwd / "train.py").read_text()
    (tmp_cwd / "mine.py").write_text("print('mine')\n")
    with pytest.raises(ExportError, match="not an earlier nbdist export"):
        shell.run_line_magic("nbdist", "export mine.py")
    shell.run_line_magic("nbdist", "export mine.py --force")
    shell.run_line_magic("nbdist", "profile save saved.yaml")
    assert "workers: 2" in (tmp_cwd / "saved.yaml").read_text()


def test_cells_without_output_flags_follow_the_session_defaults(shell, with_cluster,
                                                                monkeypatch, capsys):
    monkeypatch.setattr(with_cluster, "defaults", CellDefaults(output="all"))
    shell.run_cell_magic("distributed", "", "print('hello from', rank)")
    out = capsys.readouterr().out
    assert "[0] hello from 0" in out and "[1] hello from 1" in out
    shell.run_cell_magic("distributed", "--quiet", "print('hush', rank)")
    assert "hush" not in capsys.readouterr().out
