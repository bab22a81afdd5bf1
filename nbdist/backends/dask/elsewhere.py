"""The Dask engine's clusters started through a launcher (a batch system, SSH, Kubernetes):
how such a cluster starts, where its files go, and how it gets back to size when a worker is
lost with its nanny (a batch job or a host gone). The Dask adapter owns one :class:`Elsewhere`
for each such start; the recipes themselves are :mod:`.launchers`."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import distributed

from ...errors import ClusterError
from ...options import LaunchOptions
from ..remote import check_ssh_hosts, make_cluster_dir, remove_cluster_dir
from .launchers import cluster_spec, import_cluster_class, worker_process_config


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
    """One Dask cluster that a launcher starts (see the module's text), owned by the
    :class:`~nbdist.backends.dask.adapter.DaskBackend` that made it for one start.

    It is given what it needs: the engine's ``name`` (for the cluster's directory and the SSH
    check), ``launch``, the backend's ``tag`` (batch jobs and pods are named after it), and
    two of the backend's calls: ``live_workers()``, the workers the scheduler knows now, and
    ``await_workers(client, n, timeout)``, the wait that tells the start view as workers come.
    """

    def __init__(self, name: str, launch: LaunchOptions, tag: str,
                 live_workers: Callable[[], list[str]],
                 await_workers: Callable[[distributed.Client, int, float], None]) -> None:
        self.name = name
        self.launch = launch
        self.tag = tag
        self.live_workers = live_workers
        self.await_workers = await_workers
        #: the cluster, once made (None again once closed)
        self.cluster: Any = None
        self.client: Optional[distributed.Client] = None
        #: a batch launcher's directory for its jobs' output
        self.dir: Optional[str] = None
        #: True once every worker came up (a failed start keeps :attr:`dir`)
        self.started = False

    def start(self, n: int, timeout: float) -> None:
        """Start ``n`` workers through the launcher and wait for them; :attr:`cluster` and
        :attr:`client` are set as soon as they exist, so that whoever stops a failed start
        finds them. Batch jobs write their output into a directory of the cluster's own; SSH
        hosts are checked before anything starts there.

        Raises
        ------
        ClusterError
            A batch launcher's workers did not come up; the message names the directory
            with the jobs' output, which is kept.
        """
        launcher = self.launch.launcher
        if launcher in ("slurm", "pbs", "sge", "lsf"):
            self.dir = make_cluster_dir(self.name)
        module, name, package, kwargs, scale = cluster_spec(self.launch, n, self.tag, self.dir)
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
                self.await_workers(self.client, n, timeout)
        except Exception as exc:
            if self.dir:  # kept: the jobs' output says why
                raise ClusterError(f"{type(exc).__name__}: {exc}; the jobs' output is in "
                                   f"{self.dir}") from exc
            raise
        self.started = True

    def close(self) -> None:
        """Close the cluster; its directory goes too once every worker had come up."""
        cluster, self.cluster = self.cluster, None
        try:
            if cluster is not None:
                cluster.close()
        finally:
            if self.started:
                remove_cluster_dir(self.dir)

    def replace_when_dropped(self, size: int) -> None:
        """:meth:`rescale_when_dropped`, in a thread of its own."""
        threading.Thread(target=self.rescale_when_dropped, args=(size,), daemon=True,
                         name="nbdist-replace").start()

    def rescale_when_dropped(self, size: int, within: float = 60.0) -> None:
        """Elsewhere a nanny may have gone with its worker (a batch job or a host lost):
        Dask then drops that worker from the cluster (``distributed.deploy.lost-worker-
        timeout`` after it left), and a new one is asked for (a new batch job); a nanny that
        restarted its worker instead ends the wait, and so does closing the cluster."""
        cluster, deadline = self.cluster, time.monotonic() + within
        while cluster is not None and cluster is self.cluster and time.monotonic() < deadline:
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
