"""The ipyparallel adapter with the clusters its launchers start or it connects to: a killed
engine's log, scaling a cluster nbdist did not start, the engines of a queued batch job, an
ipcluster profile reached by its name. Nothing is started here."""

from __future__ import annotations

import logging

import ipyparallel as ipp
import pytest


@pytest.mark.parametrize("exit_code, shown", [(-9, False), (1, True)])
def test_the_log_of_an_engine_killed_by_a_signal_is_not_shown(tmp_path, exit_code, shown):
    # nbdist names a killed rank itself; ipyparallel's warning with the engine's own log
    # (registration lines) stays only for an engine that exited with a status of its own.
    from nbdist.backends.ipyparallel.adapter import _KilledEngineLog

    cluster = ipp.Cluster(n=2, profile_dir=str(tmp_path))
    cluster.log.addFilter(_KilledEngineLog(cluster))
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    cluster.log.addHandler(handler)
    engines = cluster.engine_launcher_class(work_dir=str(tmp_path), parent=cluster,
                                            log=cluster.log, profile_dir=str(tmp_path),
                                            cluster_id="c1")
    cluster.engines["set1"] = engines
    log_file = tmp_path / "ipengine-1.log"
    log_file.write_text("[IPEngine.1] Completed registration with id 1\n")
    engine = engines.launchers["1"] = engines.launcher_class(
        work_dir=str(tmp_path), parent=engines, log=cluster.log, profile_dir=str(tmp_path),
        cluster_id="c1", identifier="1", output_file=str(log_file))
    engine.notify_stop({"exit_code": exit_code, "pid": 12345})
    assert any(m.startswith("Output for 1:") for m in seen) is shown, seen


def test_scaling_an_ipyparallel_cluster_nbdist_did_not_start_names_its_tools():
    from nbdist.backends.ipyparallel.adapter import IpyparallelBackend
    from nbdist.errors import ClusterError

    backend = IpyparallelBackend()
    backend.client = object()  # connected, to a cluster someone else started
    with pytest.raises(ClusterError) as info:
        backend.scale(3, 1)
    assert "(ipcluster, Slurm, ...), then run %nbdist restart" in str(info.value)


def test_engines_of_a_queued_batch_job_count_as_still_to_come():
    # A batch job's engine set has no launcher per engine; nothing here sees the job in the
    # queue, so all its engines may still come. Per-engine (SSH) launchers count while their
    # process runs.
    from types import SimpleNamespace

    from nbdist.backends.ipyparallel.adapter import IpyparallelBackend

    class Thread:
        def __init__(self, alive):
            self.alive = alive

        def is_alive(self):
            return self.alive

    ssh = SimpleNamespace(launchers={
        1: SimpleNamespace(state="running", _wait_thread=Thread(True)),
        2: SimpleNamespace(state="running", _wait_thread=Thread(False)),
        3: SimpleNamespace(state="after")})
    backend = IpyparallelBackend()
    backend.cluster = SimpleNamespace(engines={"job": SimpleNamespace(state="running", n=2),
                                               "ssh": ssh})
    assert backend._engines_to_come() == 3
    backend.cluster.engines["job"].state = "after"  # the job was cancelled (stop)
    assert backend._engines_to_come() == 1


@pytest.mark.parametrize("given", [{"ipp_profile": "train"}, {"profile": "train"}])
def test_connect_reaches_the_ipcluster_profile_by_its_name(monkeypatch, given):
    from nbdist.backends.ipyparallel.adapter import IpyparallelBackend
    from nbdist.errors import ClusterError

    seen = {}

    def client(*args, **kwargs):
        seen.update(kwargs)
        raise OSError("no controller here")

    monkeypatch.setattr(ipp, "Client", client)
    with pytest.raises(ClusterError, match="no controller here"):
        IpyparallelBackend().connect(1.0, **given)
    assert seen["profile"] == "train" and "ipp_profile" not in seen
