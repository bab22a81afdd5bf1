"""A Dask cluster that a launcher starts is an object the Dask adapter owns: it is made for one
start with what it needs, keeps a batch launcher's output when a start fails, removes it once a
started cluster closes, and asks for a replacement only while its cluster is open.

The launcher's cluster class is a recording stand-in (no batch system here); the rest is real.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("distributed")

from nbdist.backends.dask import elsewhere as elsewhere_mod  # noqa: E402
from nbdist.backends.dask.adapter import DaskBackend  # noqa: E402
from nbdist.backends.dask.elsewhere import Elsewhere  # noqa: E402
from nbdist.errors import ClusterError, WorkersDidNotStart  # noqa: E402
from nbdist.options import LaunchOptions  # noqa: E402


class QueueCluster:
    """Stands in for dask-jobqueue's cluster classes: records what nbdist asks of it."""

    made: list[QueueCluster] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.scaled: list[int] = []
        self.closed = False
        self.workers: dict[str, Any] = {}
        QueueCluster.made.append(self)

    def scale(self, n: int) -> None:
        self.scaled.append(n)

    def close(self) -> None:
        self.closed = True


class Client:
    """What the backend asks of the client of a cluster it started elsewhere."""

    def __init__(self, cluster: QueueCluster, timeout: float) -> None:
        self.cluster = cluster
        self.scheduler = SimpleNamespace(address="tcp://10.0.0.1:8786")
        self.topics: list[str] = []
        self.closed = False
        self.waited: list[tuple[int, float]] = []

    def nthreads(self) -> dict[str, int]:
        return {}

    def wait_for_workers(self, n: int, timeout: float) -> None:
        self.waited.append((n, timeout))

    def subscribe_topic(self, topic: str, handler: Any) -> None:
        self.topics.append(topic)

    def unsubscribe_topic(self, topic: str) -> None:
        self.topics.remove(topic)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def slurm(monkeypatch, tmp_path):
    """A 'slurm' launch whose cluster class is :class:`QueueCluster`; cluster directories in
    ``tmp_path``."""
    monkeypatch.setenv("NBDIST_CLUSTER_DIR", str(tmp_path))
    QueueCluster.made = []

    def spec(launch, n, tag, cluster_dir):
        return ("dask_jobqueue", "SLURMCluster", "dask-jobqueue",
                {"log_directory": cluster_dir, "name": tag}, True)

    monkeypatch.setattr(elsewhere_mod, "cluster_spec", spec)
    monkeypatch.setattr(elsewhere_mod, "import_cluster_class", lambda *a: QueueCluster)
    monkeypatch.setattr(elsewhere_mod, "new_client",
                        lambda cluster, timeout: Client(cluster, timeout))
    return LaunchOptions(launcher="slurm", listen="10.0.0.1")


def made_with(slurm, await_workers=lambda client, n, timeout: None,
              live_workers=lambda: []) -> Elsewhere:
    return Elsewhere("dask", slurm, "nbdist-t1", live_workers, await_workers)


def test_a_started_cluster_has_its_jobs_directory_until_it_closes(slurm):
    waited = []
    e = made_with(slurm, await_workers=lambda client, n, timeout: waited.append((n, timeout)))
    e.start(3, 30.0)
    cluster = e.cluster
    assert cluster.kwargs == {"log_directory": e.dir, "name": "nbdist-t1"}
    assert cluster.scaled == [3] and waited == [(3, 30.0)] and e.client.cluster is cluster
    assert e.started and os.path.isdir(e.dir)
    e.close()
    assert cluster.closed and e.cluster is None and not os.path.exists(e.dir)


def test_a_failed_start_names_and_keeps_the_jobs_output(slurm):
    def never(client, n, timeout):
        raise TimeoutError(f"only 1 of {n} workers within {timeout} s")

    e = made_with(slurm, await_workers=never)
    with pytest.raises(ClusterError, match=r"TimeoutError: only 1 of 2 workers within 5.0 s; "
                                           r"the jobs' output is in .*dask-"):
        e.start(2, 5.0)
    assert e.cluster is QueueCluster.made[0]  # there, so that its owner can stop it
    e.close()
    assert QueueCluster.made[0].closed and os.path.isdir(e.dir)  # kept: it says why


def test_a_dropped_worker_is_asked_for_again_only_while_the_cluster_is_open(slurm):
    live = ["w1"]
    e = made_with(slurm, live_workers=lambda: live)
    e.start(2, 5.0)
    cluster = e.cluster
    e.rescale_when_dropped(2, within=5.0)  # Dask dropped the lost one: one more is asked for
    assert cluster.scaled == [2, 2]
    live.append("w2")
    e.rescale_when_dropped(2, within=5.0)  # back to size: nothing to ask
    assert cluster.scaled == [2, 2]
    live.pop()
    e.close()
    e.rescale_when_dropped(2, within=5.0)  # closed: nothing is asked of it
    assert cluster.scaled == [2, 2]


def test_the_dask_backend_owns_the_cluster_it_started_elsewhere(slurm):
    backend = DaskBackend()
    backend.launch = slurm
    backend.start(2, 5.0)
    own = backend._elsewhere
    assert own is not None and backend.cluster is own.cluster and backend.client is own.client
    assert backend.controller_ip == "10.0.0.1" and own.client.waited == [(2, 5.0)]
    assert own.tag == backend._tag  # the batch jobs are named after the backend's tag
    backend.stop()
    assert own.cluster is None and QueueCluster.made[0].closed
    assert not os.path.exists(own.dir) and backend._elsewhere is None


def test_the_dask_backend_stops_a_cluster_that_did_not_start_and_keeps_its_output(slurm,
                                                                                  monkeypatch):
    def never(self, client, n, timeout):
        raise TimeoutError("no worker came up")

    monkeypatch.setattr(DaskBackend, "_await_dask", never)
    backend = DaskBackend()
    backend.launch = slurm
    with pytest.raises(WorkersDidNotStart) as err:
        backend.start(2, 5.0)
    assert isinstance(err.value.__cause__, ClusterError)
    assert QueueCluster.made[0].closed and backend.cluster is None
    [kept] = [d for d in os.listdir(os.environ["NBDIST_CLUSTER_DIR"]) if d.startswith("dask-")]
    assert kept in str(err.value.__cause__)
