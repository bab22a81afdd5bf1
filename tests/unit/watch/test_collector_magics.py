"""``%nbdist attach``, ``%nbdist jobs`` and ``%nbdist job ID show|stacks|detach`` in a real IPython
shell, and their Python twins: the same collector, the same line, the same records."""

from __future__ import annotations

import pytest

pytest.importorskip("IPython")

from IPython.core.error import UsageError  # noqa: E402
from synthetic import T0, batches, training_events  # noqa: E402

import nbdist  # noqa: E402
from nbdist.telemetry import events as ev  # noqa: E402
from nbdist.watch import collector as col  # noqa: E402

KEY = "torchrun-abc"


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(col, "_current", None)
    yield
    if col._current is not None:
        col._current.close()


def _job_of_two(jobs, steps=4):
    for rank in (0, 1):
        jobs.fold({"type": "rank", "job": KEY, "rank": rank, "world_size": 2, "host": "n1",
                   "pid": 100 + rank}, 1)
        for b in batches(rank, training_events(steps) + [ev.end(True, T0 + 5)]):
            jobs.fold({"type": "batch", "job": KEY, "batch": b}, 1)
        jobs.fold({"type": "exit", "job": KEY, "rank": rank, "pid": 100 + rank, "ok": True},
                  1)
    jobs.fold({"type": "bye", "code": 0}, 1)


def test_attach_prints_the_line_and_examples_and_again_the_same_line(shell, capsys, fresh):
    shell.run_line_magic("nbdist", "attach")
    out = capsys.readouterr().out
    collector = nbdist.attach()
    assert out.splitlines()[0] == collector.line
    assert collector.line.startswith("NBDIST_ATTACH=tcp://127.0.0.1:")
    # the launches as this environment runs them (an editable install has no start-up
    # hook: through the agent; test_collector.py has both forms)
    assert "torchrun --nproc_per_node=2 " in out and "sbatch --export=ALL," in out
    assert "-m nbdist.agent train.py" in out and "loopback" in out
    shell.run_line_magic("nbdist", "attach  # again")
    assert capsys.readouterr().out.splitlines()[0] == collector.line
    assert nbdist.attach() is collector


def test_a_bad_attach_is_a_usage_error_that_says_why(shell, fresh):
    with pytest.raises(UsageError, match=r"--listen takes \[HOST:\]PORT"):
        shell.run_line_magic("nbdist", "attach --listen nowhere")
    with pytest.raises(UsageError, match="TLS needs both"):
        shell.run_line_magic("nbdist", "attach --tls-cert c.pem")


def test_jobs_and_job_show_the_records_and_detach_forgets(shell, capsys, fresh):
    assert nbdist.jobs() == []
    shell.run_line_magic("nbdist", "jobs")
    assert "no jobs watched" in capsys.readouterr().out
    collector = nbdist.attach()
    capsys.readouterr()
    _job_of_two(collector.jobs)
    (rec,) = nbdist.jobs()
    assert (rec.id, rec.world_size, rec.hosts, rec.state, rec.steps) == (
        "1", 2, ("n1",), "finished", {0: 4, 1: 4})
    assert rec.started > 0
    shell.run_line_magic("nbdist", "jobs")
    assert capsys.readouterr().out.strip() == rec.line()
    shell.run_line_magic("nbdist", "job 1 show")
    shown = capsys.readouterr().out
    assert shown.startswith(rec.line()) and "nbdist run:" in shown
    assert nbdist.job("1").record == rec and nbdist.job(KEY).id == "1"
    shell.run_line_magic("nbdist", "job 1 stacks --rank 0")  # it ended: no rank to ask
    assert capsys.readouterr().out.strip() == "job 1: no running rank to ask"
    assert nbdist.job("1").stacks() == {}
    with pytest.raises(UsageError, match="no watched job '7'; jobs: 1"):
        shell.run_line_magic("nbdist", "job 7 show")
    shell.run_line_magic("nbdist", "job 1 detach")
    assert "job 1 (torchrun-abc) detached" in capsys.readouterr().out
    assert nbdist.jobs() == []
    with pytest.raises(LookupError, match="job 1 .* was detached"):
        nbdist.job("1")


def test_with_the_collector_listening_no_job_says_why_and_the_line_not_attach_first(
        shell, capsys, fresh):
    shell.run_line_magic("nbdist", "jobs")  # nothing listens: attach, named as typed here
    assert capsys.readouterr().out.strip() == "no jobs watched (%nbdist attach first)"
    with pytest.raises(UsageError, match=r"jobs: none \(%nbdist attach first\)"):
        shell.run_line_magic("nbdist", "job 1 show")
    with pytest.raises(LookupError, match=r"jobs: none \(nbdist\.attach\(\) first\)"):
        nbdist.job(1)
    collector = nbdist.attach()
    shell.run_line_magic("nbdist", "jobs")
    out = capsys.readouterr().out
    assert "no job has reported yet" in out and collector.line in out
    assert "attach first" not in out
    _job_of_two(collector.jobs)
    shell.run_line_magic("nbdist", "job 1 detach")
    capsys.readouterr()
    shell.run_line_magic("nbdist", "jobs")
    out = capsys.readouterr().out
    assert "job 1 (torchrun-abc) detached, and no other job has reported" in out
    assert collector.line in out and "(%nbdist attach shows how)" in out
    assert "attach first" not in out and "nbdist.attach()" not in out
    with pytest.raises(UsageError) as magic:
        shell.run_line_magic("nbdist", "job 1 show")
    said = str(magic.value)
    assert "job 1 (torchrun-abc) was detached" in said and collector.line in said
    assert "%nbdist attach shows how" in said and "nbdist.attach()" not in said
    with pytest.raises(LookupError) as python:
        nbdist.job("1")
    said = str(python.value)
    assert "was detached" in said and "(nbdist.attach() shows how)" in said
    assert "%nbdist" not in said and "attach first" not in said


def test_stacks_of_a_rank_not_in_the_job_say_its_ranks(shell, capsys, fresh):
    _job_of_two(nbdist.attach().jobs)
    with pytest.raises(UsageError, match=r"%nbdist job 1 stacks: rank 5 is not in job 1 "
                       r"\(torchrun-abc\): its ranks are 0\.\.1 \(world size 2\)"):
        shell.run_line_magic("nbdist", "job 1 stacks --rank 5")
    with pytest.raises(LookupError, match=r"rank 5 is not in job 1 .*0\.\.1"):
        nbdist.job("1").stacks(rank=5)
    with pytest.raises(LookupError, match="rank -1 is not in job 1"):
        nbdist.job("1").stacks(rank=-1)
    shell.run_line_magic("nbdist", "job 1 stacks --rank 1")  # in the job, but it ended
    assert capsys.readouterr().out.strip() == "job 1: no running rank to ask"


def test_tls_and_token_file_mistakes_are_usage_errors_that_name_the_file(shell, fresh,
                                                                         tmp_path):
    with pytest.raises(UsageError, match=r"%nbdist attach: TLS certificate /nonexist\.pem "
                       "does not exist"):
        shell.run_line_magic("nbdist", "attach --tls-cert /nonexist.pem --tls-key /nonexist.key")
    with pytest.raises(UsageError, match=f"token file {tmp_path} is a directory"):
        shell.run_line_magic("nbdist", f"attach --token-file {tmp_path}")
