"""ipyparallel engine: an embedded local cluster, or any cluster ipyparallel's launchers reach."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional
from urllib.parse import urlparse

import ipyparallel as ipp

from ..errors import ClusterError
from ..telemetry.events import Batch
from .base import Backend, Call, Job, Outcome, WorkerId

_KEY = "nbdist:"
# The controller confirms new engines at its next heart beat; ipyparallel's default period
# (3 s) makes a local start wait for it. Checking more often, with more misses allowed,
# keeps the same 10 s tolerance for an engine that stops answering.
_HEARTBEAT_ARGS = ["--HeartMonitor.period=500", "--HeartMonitor.max_heartmonitor_misses=20"]


def publish(batch: Batch) -> None:
    """Worker side: send one event batch over the engine's IOPub channel."""
    from ipyparallel.datapub import publish_data

    # Unique keys, because the client merges data messages into one dict per request.
    publish_data({f"{_KEY}{batch['rank']}:{batch['seq']}": batch})


class _IppJob(Job):
    def __init__(self, client: ipp.Client, results: list[tuple[WorkerId, Any]]):
        self._client = client
        self._results = results

    def wait(self, timeout: Optional[float]) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for _, ar in self._results:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not ar.wait(left):
                return False
        return True

    def pending(self) -> list[WorkerId]:
        return [w for w, ar in self._results if not ar.ready()]

    def outcomes(self) -> list[Outcome]:
        out = []
        for w, ar in self._results:
            try:
                out.append(Outcome(w, value=ar.get(0)))
            except ipp.error.RemoteError as e:
                out.append(Outcome(w, engine_error=f"{e.ename}: {e.evalue}\n{e.traceback or ''}"))
            except Exception as e:  # engine died, or unregistered mid-call
                out.append(Outcome(w, engine_error=f"{type(e).__name__}: {e}"))
        return out

    def drain_events(self) -> list[Batch]:
        batches = []
        for _, ar in self._results:
            mds = ar.metadata  # the live dicts the client's IO thread updates
            for md in mds if isinstance(mds, list) else [mds]:
                data = md["data"]
                for key in [k for k in list(data) if k.startswith(_KEY)]:
                    batches.append(data.pop(key))
        return batches


class IpyparallelBackend(Backend[ipp.Client]):
    """Workers are ipyparallel engines; their channel is authenticated by the cluster's key."""

    name = "ipyparallel"
    _launchers = "ipcluster, Slurm, ..."
    cluster: Optional[ipp.Cluster]

    def _start(self, n: int, timeout: float) -> None:
        # Controller and engines listen on loopback only; the connection files carry the key.
        self.cluster = ipp.Cluster(n=n, controller_ip="127.0.0.1", log_level=logging.WARNING,
                                   controller_args=_HEARTBEAT_ARGS)
        self.cluster.start_controller_sync()
        self.cluster.start_engines_sync(n)
        self.client = self.cluster.connect_client_sync()
        # No progress bar: the session shows its own status when the job is formed.
        self.client.wait_for_engines(n, timeout=timeout, interactive=False)
        self.controller_ip = "127.0.0.1"

    def connect(self, timeout: float, **target: Any) -> None:
        kwargs = {k: v for k, v in target.items() if v is not None}
        # ipyparallel 9 takes the connection file positionally; its url_file= is ignored.
        connection_info = kwargs.pop("url_file", None)
        try:
            self.client = ipp.Client(connection_info, timeout=timeout, **kwargs)
            self.client.wait_for_engines(1, timeout=timeout, interactive=False)
        except Exception as exc:
            raise ClusterError(
                f"could not connect to the ipyparallel cluster {kwargs or '(default profile)'}: "
                f"{exc}. Check that `ipcluster start` is running and the connection file is "
                "readable here."
            ) from exc
        self.owns_cluster = False
        url = getattr(self.client, "_config", {}).get("registration") or ""
        self.controller_ip = urlparse(url).hostname

    def worker_ids(self) -> list[WorkerId]:
        return sorted(self._require().ids)

    def submit(self, calls: Sequence[Call]) -> Job:
        client = self._require()
        results = []
        for c in calls:
            view = client[c.worker]
            results.append((c.worker, view.apply_async(c.fn, *c.args, **(c.kwargs or {}))))
        return _IppJob(client, results)

    def interrupt(self, workers: Sequence[WorkerId]) -> None:
        if workers:
            self._require().send_signal(signal.SIGINT, targets=list(workers), block=False)

    def _grow(self, k: int, timeout: float) -> None:
        client, cluster = self._require(), self.cluster
        assert cluster is not None  # scale() checked
        want = len(client.ids) + k
        cluster.start_engines_sync(k)
        client.wait_for_engines(want, timeout=timeout, interactive=False)

    def _retire(self, ids: Sequence[WorkerId], timeout: float) -> None:
        # Returns once the engines were told; they leave client.ids at their unregistration.
        self._require().shutdown(targets=list(ids), block=True)

    def _close_cluster(self, cluster: ipp.Cluster) -> None:
        # Engines stopped on purpose exit non-zero; ipyparallel would log that as a warning.
        cluster.log.setLevel(logging.ERROR)
        cluster.stop_cluster_sync()

    def transport(self) -> Callable[[Batch], None]:
        return publish

    def describe(self) -> str:
        if self.cluster is not None:
            return f"ipyparallel (local cluster {self.cluster.cluster_id})"
        return "ipyparallel (connected)"
