"""How the magics read their line in a real IPython shell, on a scripted session: ``-h`` on
every verb, a trailing ``# comment``, connect's old ``--profile``, and the cell's prompt number."""

from __future__ import annotations

import pytest

pytest.importorskip("IPython")

from IPython.core.error import UsageError  # noqa: E402

from nbdist.magics import _VERBS, split_line  # noqa: E402


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_every_verb_and_the_cell_magic_answer_help_and_run_nothing(shell, backend, capsys,
                                                                   flag):
    calls = len(backend.calls)
    assert shell.run_line_magic("nbdist", flag) is None
    assert "%nbdist [-h] VERB" in capsys.readouterr().out
    for verb in _VERBS:
        assert shell.run_line_magic("nbdist", f"{verb} {flag}") is None, verb
        assert f"%nbdist {verb} [-h]" in capsys.readouterr().out, verb
    assert shell.run_cell_magic("distributed", flag, "raise SystemExit") is None
    assert "--ranks SPEC" in capsys.readouterr().out
    assert len(backend.calls) == calls  # nothing reached the workers


def test_scale_help_says_what_n_is_and_how_ranks_follow(shell, capsys):
    shell.run_line_magic("nbdist", "scale -h")
    text = " ".join(capsys.readouterr().out.split())
    assert "N the workers (world size) wanted: not a number to add or remove." in text
    assert ("The highest ranks leave; workers that stay keep their ranks; new workers take the "
            "ranks of workers that left, then the next ones") in text


def test_a_script_gets_its_own_help_flag(shell, session, monkeypatch):
    seen = []
    monkeypatch.setattr(session, "run_script", lambda path, argv, **kw: seen.append(argv))
    shell.run_line_magic("nbdist", "run train.py -h --epochs 1")
    assert seen == [["-h", "--epochs", "1"]]


def test_a_trailing_comment_is_read_as_python_reads_it(shell, session, monkeypatch):
    assert split_line("start -n 2  # two CPU workers") == ["start", "-n", "2"]
    assert split_line("compare 'run #2'  # quoted: kept") == ["compare", "run #2"]
    assert shell.run_cell("%nbdist status  # which workers").success
    seen = []
    monkeypatch.setattr(session, "run_cell", lambda cell, **kw: seen.append(kw))
    assert shell.run_cell("%%distributed --quiet --name 'run #2'  # named\nx = 1\n").success
    assert seen[0]["output"] == "quiet" and seen[0]["name"] == "run #2"
    with pytest.raises(UsageError, match="No closing quotation"):
        shell.run_line_magic("nbdist", "start 'two")


def test_connect_profile_is_ipp_profile_and_the_old_spelling_still_works(shell, capsys):
    # Both reach the check that rejects TLS flags for ipyparallel, the old one with a note.
    for line in ("connect --ipp-profile mpi", "connect --profile mpi"):
        with pytest.raises(UsageError, match="for --engine dask"):
            shell.run_line_magic("nbdist", f"{line} --tls-ca-file a.pem --tls-cert c.pem")
    err = capsys.readouterr().err
    assert err.count("deprecated: use --ipp-profile NAME") == 1
    with pytest.raises(UsageError, match="give --ipp-profile only"):
        shell.run_line_magic("nbdist", "connect --profile a --ipp-profile b")


def test_the_cell_is_named_by_the_number_its_prompt_shows(shell, session, monkeypatch):
    seen = []
    monkeypatch.setattr(session, "run_cell", lambda cell, **kw: seen.append(kw))
    prompt = shell.execution_count  # the next stored cell's In [n], on IPython 8 and 9 alike
    assert shell.run_cell("%%distributed\nx = 1\n", store_history=True).success
    assert shell.run_cell("%%distributed\nx = 1\n", store_history=True).success
    assert [kw["execution_count"] for kw in seen] == [prompt, prompt + 1]
    assert shell.run_cell("%%distributed\nx = 1\n", store_history=False).success
    assert seen[-1]["execution_count"] is None  # not a numbered cell: no In [n] to name


def test_a_cell_magics_line_is_parsed_once_and_each_run_gets_its_own_arguments():
    import argparse

    from nbdist.magics.parsers import parse_cached

    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=None)
    seen = []
    real = parser.parse_args
    parser.parse_args = lambda words: seen.append(words) or real(words)  # type: ignore
    first = parse_cached(parser, "--timeout 5")
    first.timeout = 99.0  # what a caller does with its copy stays its own
    again = parse_cached(parser, "--timeout 5")
    assert again.timeout == 5.0 and again is not first
    assert seen == [["--timeout", "5"]]  # argparse ran once for the line
    assert parse_cached(parser, "").timeout is None
    for _ in range(2):  # a bad line is not remembered: it fails every time
        with pytest.raises(SystemExit):
            parse_cached(parser, "--timeout soon")
    assert len(seen) == 4
