"""The Dask engine's clusters started through a launcher (a batch system, SSH, Kubernetes):
how such a cluster starts, where its files go, and how it gets back to size when a worker is
lost with its nanny (a batch job or a host gone). :class:`.dask.DaskBackend` mixes this in;
the recipes themselves are :mod:`.launchers`."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import distributed

from ...errors import ClusterError
from ...options import LaunchOptions
from ..launchers import cluster_spec, import_cluster_class, worker_process_config
from ..remote import check_ssh_hosts, make_cluster_dir, remove_cluster_dir


def new_client(*args: Any, **kwargs: Any) -> distributed.Client:
    """``distributed.Client(...)``, tried twice.

    Right after another client of this process failed or closed, Dask's IO-loop thread
    sometimes does not come up within its own 10 s wait and the constructor fails with a bare
    ``AssertionError`` (seen after a refused TLS connection); a second try starts a fresh one.
    """
    try:
        return distributed.Client(*args, **kwargs)
    except AssertionError:
        return distributed.Client(*args, **kwargs)


class Elsewhere:
    """The part of the Dask backend for clusters a launcher starts (see the module's text)."""

    launch: LaunchOptions
    name: str
    cluster: Any
    client: Optional[distributed.Client]
    _tag: str
    live_workers: Callable[[], list[str]]
    _dir: Optional[str] = None  # a batch launcher's directory for its jobs' output
    _started = False  # True once every worker came up (a failed start keeps _dir)

    def _start_elsewhere(self, n: int, timeout: float) -> None:
        """Workers through a launcher: batch jobs write their output into a directory of the
        cluster's own; SSH hosts are checked before anything starts there."""
        launcher = self.launch.launcher
        if launcher in ("slurm", "pbs", "sge", "lsf"):
            self._dir = make_cluster_dir(self.name)
        module, name, package, kwargs, scale = cluster_spec(self.launch, n, self._tag,
                                                            self._dir)
        cls = import_cluster_class(module, name, package, launcher)
        if launcher == "ssh":  # each host's address on the route to listen
            hosts, kwargs["remote_python"] = check_ssh_hosts(self.launch, self.name)
            kwargs["routes"] = {h.name: h.route for h in hosts}
        try:
            with worker_process_config(local=False):  # SSH hosts inherit this config
                self.cluster = cls(**kwargs)
                if scale:
                    self.cluster.scale(n)
                self.client = new_client(self.cluster, timeout=timeout)
                self._await_workers(self.client.nthreads, n, timeout,
                                    self.client.wait_for_workers)
        except Exception as exc:
            if self._dir:  # kept: the jobs' output says why
                raise ClusterError(f"{type(exc).__name__}: {exc}; the jobs' output is in "
                                   f"{self._dir}") from exc
            raise
        self._started = True

    def _close_cluster(self, cluster: Any) -> None:
        try:
            cluster.close()
        finally:
            if self._started:
                remove_cluster_dir(self._dir)

    def _replace_when_dropped(self, size: int) -> None:
        """:meth:`_rescale_when_dropped`, in a thread of its own."""
        threading.Thread(target=self._rescale_when_dropped, args=(size,), daemon=True,
                         name="nbdist-replace").start()

    def _rescale_when_dropped(self, size: int, within: float = 60.0) -> None:
        """Elsewhere a nanny may have gone with its worker (a batch job or a host lost):
        Dask then drops that worker from the cluster (``distributed.deploy.lost-worker-
        timeout`` after it left), and a new one is asked for (a new batch job); a nanny that
        restarted its worker instead ends the wait."""
        cluster, deadline = self.cluster, time.monotonic() + within
        while cluster is self.cluster and time.monotonic() < deadline:
            try:
                if len(self.live_workers()) >= size:
                    return
                if len(getattr(cluster, "workers", {})) < size:
                    with worker_process_config(local=False):
                        getattr(cluster, "replace_lost", cluster.scale)(size)
                    return
            except Exception:  # the cluster is stopping: nothing to replace
                return
            time.sleep(0.5)  # Dask's drop of a lost worker offers nothing to wait on
