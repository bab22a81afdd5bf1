"""The session with profiles, its record of cells and pushes, export and profile save, on the
scripted in-memory backend."""

from __future__ import annotations

import textwrap

import pytest
from fakes import Scripted, ScriptedBackend, failed

from nbdist.errors import (
    CellTimeoutError,
    ClusterError,
    DistributedError,
    OptionError,
    ProfileError,
)
from nbdist.exporter.history import CellEntry, PushEntry
from nbdist.options import Measure
from nbdist.profiles import load_profile, to_options
from nbdist.session import Session


class RecordingBackend(ScriptedBackend):
    """Also keeps the keyword arguments of every call, by function name."""

    def __init__(self, n: int = 2) -> None:
        super().__init__(n)
        self.kwargs: dict[str, list[dict]] = {}

    def submit(self, calls):
        for c in calls:
            self.kwargs.setdefault(c.fn.__name__, []).append(dict(c.kwargs or {}))
        return super().submit(calls)

    def _grow(self, k: int, timeout: float) -> None:
        self.ids += [max(self.ids) + 1 + i for i in range(k)]


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "team.yaml"
    path.write_text(textwrap.dedent(f"""
        cluster:
          workers: 3
        runtime:
          device: cpu
          threads: 2
          timeout: 20
          env: {{TEAM: ml}}
          working_dir: {tmp_path}
        training:
          output: quiet
          telemetry: false
          cell_timeout: 0.05
          elastic: {{max_failures: 4}}
    """))
    return path


def make(n: int = 3):
    made: list[RecordingBackend] = []

    def factory(engine: str) -> RecordingBackend:
        made.append(RecordingBackend(n))
        return made[-1]

    return Session(backends=factory, stores=None), made


def test_start_from_a_profile_with_overrides(profile, tmp_path):
    session, made = make()
    session.start(profile=profile, threads=1, timeout=30)
    (backend,) = made
    assert session.options.n == 3 and session.options.threads == 1  # the override wins
    assert session.options.timeout == 30 and session.options.device == "cpu"
    assert session.defaults.output == "quiet" and session.defaults.elastic_max_failures == 4
    assert session.profile_path == str(profile)
    assert backend.launch.launcher == "local"
    assert all(p.extra == {"TEAM": "ml"} and p.env(1)["TEAM"] == "ml" for p in session.plans)
    assert backend.kwargs["join"] == [{"working_dir": str(tmp_path)}] * 3


def test_cells_take_the_profiles_training_defaults(profile):
    session, made = make()
    session.start(profile=profile)
    backend = made[0]
    session.run_cell("x = 1")
    kwargs = backend.kwargs["run_cell"][-1]
    assert kwargs["measure"] == Measure(telemetry=False) and kwargs["coordinated"] is False
    assert not kwargs["link"].stdin  # no store here: no one can answer a breakpoint()
    # the cell's own flags win, and the record travels whole
    session.run_cell("x = 1", telemetry=True, bucket_timing=True, stall_after=5)
    assert backend.kwargs["run_cell"][-1]["measure"] == Measure(telemetry=True, buckets=True,
                                                                stall_after=5)
    backend.script(r0=Scripted(hang=True))
    with pytest.raises(CellTimeoutError, match="0.05 s"):  # training.cell_timeout
        session.run_cell("while True: pass")


def test_a_plain_start_forgets_the_profiles_defaults(profile):
    session, _ = make()
    session.start(profile=profile)
    session.start(2)
    assert session.defaults.output == "rank0" and session.profile_path is None
    assert session.options.env == {} and session.options.threads is None


@pytest.mark.parametrize("text,message", [
    ("cluster:\n  wrkers: 2\n", "line 2: cluster.wrkers: unknown key; did you mean 'workers'"),
    ("runtime:\n  timeout: soon\n", "line 2: runtime.timeout: Input should be a valid number"),
])
def test_a_bad_profile_starts_nothing(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    session, made = make()
    with pytest.raises(ProfileError, match=message):
        session.start(profile=path)
    with pytest.raises(ProfileError, match="no such file"):
        session.start(profile=tmp_path / "missing.yaml")
    assert made == [] and not session.running


def test_a_running_session_is_not_stopped_by_a_bad_profile(tmp_path):
    session, made = make()
    session.start(2)
    (tmp_path / "bad.yaml").write_text("cluster: {engine: spark}\n")
    with pytest.raises(ProfileError):
        session.start(profile=tmp_path / "bad.yaml")
    assert session.running and len(made) == 1


def test_history_records_what_succeeded_and_restarts_with_the_group():
    session, made = make(2)
    session.start(2)
    backend = made[0]
    session.push({"lr": 0.1})
    session.run_cell("a = lr")
    backend.script(r1=Scripted(failed("ValueError", "bad")))
    with pytest.raises(DistributedError):
        session.run_cell("raise ValueError('bad')")
    session.run_cell("b = 2", ranks="1")
    entries = session.history.entries
    assert [type(e) for e in entries] == [PushEntry, CellEntry, CellEntry]
    assert entries[1] == CellEntry(1, "a = lr", None)
    assert entries[2] == CellEntry(3, "b = 2", (1,))  # cell 2 failed: not recorded
    session.scale(3)
    assert len(session.history) == 0


def test_export_and_profile_save_through_the_session(tmp_path, profile):
    session, _ = make()
    session.start(profile=profile)
    session.push({"steps": 3})
    session.run_cell("for i in range(steps): pass")
    out = session.export(str(tmp_path / "train.py"))
    text = (tmp_path / "train.py").read_text()
    assert out.command == "torchrun --nproc_per_node=3 train.py"
    assert "steps = 3" in text and "os.environ.setdefault('TEAM', 'ml')" in text
    saved = session.save_profile(str(tmp_path / "saved.yaml"))
    assert to_options(load_profile(saved)) == (session.options, session.defaults)


def test_an_export_says_how_to_launch_it_watched_from_this_notebook(tmp_path, monkeypatch):
    from nbdist.watch import collector as col

    session, _ = make()
    session.start(2)
    session.run_cell("a = 1")
    monkeypatch.setattr(col, "_current", None)
    out = session.export(str(tmp_path / "train.py"))
    assert out.attach is None and "run %nbdist attach here" in out.summary()
    listening = col.attach()  # a real collector, on loopback
    try:
        out = session.export(str(tmp_path / "train.py"))
        assert out.attach == listening.line and listening.line.startswith("NBDIST_ATTACH=tcp://")
        # a launch that reports in this environment: plain where the start-up hook is
        # installed, through the agent where it is not (an editable install)
        for hooked in (True, False):
            monkeypatch.setattr(col, "hook_installed", lambda h=hooked: h)
            out = session.export(str(tmp_path / "train.py"), force=True)
            assert out.agent is not hooked
            launch = (out.command if hooked else
                      out.command.replace(" train.py", " -m nbdist.agent train.py"))
            assert f"{listening.line} {launch}" in out.summary(), out.summary()
    finally:
        listening.close()
        col._current = None


def test_dask_client_needs_an_engine_that_can_serve_dask():
    session, _ = make()
    session.start(2)
    with pytest.raises(ClusterError, match="cannot serve Dask"):
        session.dask_client()


def test_a_remote_launcher_needs_a_worker_count(tmp_path):
    path = tmp_path / "slurm.yaml"
    path.write_text("cluster: {launcher: slurm, listen: '*'}\n")
    session, made = make()
    with pytest.raises(OptionError, match="needs a number of workers"):
        session.start(profile=path)
    assert made == []
