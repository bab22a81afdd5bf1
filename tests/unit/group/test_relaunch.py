"""``start``/``connect`` while a cluster runs (:mod:`nbdist.group.relaunch`, through the
Session as users meet it), on the scripted backend: the same options keep the warm workers (one
line says so); other options say what stops and what is lost first."""

from __future__ import annotations

import pytest
from fakes import ScriptedBackend

from nbdist.session import Session


@pytest.fixture
def made() -> list[ScriptedBackend]:
    return []


@pytest.fixture
def session(made) -> Session:
    def backends(engine: str) -> ScriptedBackend:
        made.append(ScriptedBackend(3 if len(made) else 2))  # a fresh engine each launch
        return made[-1]

    return Session(backends=backends, stores=None)


def said(capsys) -> str:
    return capsys.readouterr().out


def test_the_same_start_again_keeps_the_workers_and_says_so(session, made, capsys):
    session.start(2, engine="dask", timeout=5)
    assert said(capsys) == ""  # nothing ran before: nothing to say
    first = made[0]
    first.calls.clear()
    gen = session.generation
    assert session.start(2, engine="dask", timeout=5) is session
    out = said(capsys)
    assert out.count("\n") == 1  # one line
    assert out.startswith("nbdist: already running with these options: kept its 2 workers "
                          "and their namespaces (warm state kept; `%nbdist restart` gets "
                          "fresh workers)")
    assert len(made) == 1 and session.backend is first and first.client is not None
    assert "join" not in first.calls and session.generation == gen  # nothing re-formed
    session.start(engine="dask", timeout=5)  # no -n: the default (2 on a host without GPUs)
    assert "already running" in said(capsys) and len(made) == 1


def test_other_options_say_what_stops_and_what_is_lost_then_start_anew(session, made, capsys):
    session.start(2, engine="dask", timeout=5)
    first = made[0]
    first.names = {first.ids[0]: ["model", "opt"], first.ids[1]: ["model", "opt"]}
    session.start(3, engine="dask", timeout=5, device="cpu")
    out = said(capsys)
    assert ("nbdist: a cluster is running with other options (workers 2 -> 3, device auto -> "
            "cpu): stopping its 2 workers of scripted; lost: every rank's namespace (on every "
            "rank: model, opt). Then starting the new one ...") in out
    assert first.client is None and session.backend is made[1]  # stopped, then replaced
    assert session.world_size == 3


def test_names_that_differ_by_rank_are_listed_by_rank(session, made, capsys):
    session.start(2, engine="dask", timeout=5)
    made[0].names = {made[0].ids[0]: ["losses"]}
    session.start(2, engine="ipyparallel", timeout=5)
    out = said(capsys)
    assert "(engine dask -> ipyparallel)" in out
    assert "lost: every rank's namespace (rank 0: losses; rank 1: nothing)" in out


def test_nothing_defined_yet_is_said_too(session, made, capsys):
    session.start(2, engine="dask", timeout=5)
    session.start(2, engine="dask", timeout=9)
    out = said(capsys)
    assert "(timeout 5 -> 9)" in out and "(no names defined yet)" in out


def test_a_rank_gone_is_not_kept(session, made, capsys):
    session.start(2, engine="dask", timeout=5)
    made[0].ids.pop()  # rank 1's worker died
    session.start(2, engine="dask", timeout=5)
    assert "a cluster is running with rank(s) 1 gone: stopping" in said(capsys)
    assert session.backend is made[1]


def test_connect_to_the_same_cluster_keeps_it_another_replaces_it(session, made, capsys):
    session.connect(engine="dask", address="tcp://10.0.0.5:8786", timeout=5)
    assert session.connect(engine="dask", address="tcp://10.0.0.5:8786", timeout=5) is session
    assert said(capsys).startswith("nbdist: already connected to this cluster with these "
                                   "options: kept its 2 workers")
    assert len(made) == 1
    session.connect(engine="dask", address="tcp://10.0.0.6:8786", timeout=5)
    out = said(capsys)
    assert ("a cluster is running with another cluster (address tcp://10.0.0.5:8786): "
            "disconnecting from scripted (its 2 workers keep running, with their namespaces; "
            "nbdist's process group on them ends). Then connecting ...") in out
    assert session.backend is made[1]


def test_start_while_connected_and_connect_while_started_replace(session, made, capsys):
    session.connect(engine="dask", address="tcp://10.0.0.5:8786", timeout=5)
    session.start(2, engine="dask", timeout=5)
    assert "running with workers nbdist connected to: disconnecting" in said(capsys)
    session.connect(engine="dask", address="tcp://10.0.0.5:8786", timeout=5)
    assert "running with workers nbdist started: stopping its 3 workers" in said(capsys)
    assert len(made) == 3


def test_a_kept_start_takes_the_profiles_cell_defaults(session, made, capsys, tmp_path):
    session.start(2, engine="dask", timeout=5)
    profile = tmp_path / "p.yaml"
    profile.write_text("cluster:\n  engine: dask\n  workers: 2\nruntime:\n  timeout: 5\n"
                       "training:\n  output: all\n")
    session.start(profile=str(profile))
    assert "already running" in said(capsys) and len(made) == 1
    assert session.defaults.output == "all" and session.profile_path == str(profile)
