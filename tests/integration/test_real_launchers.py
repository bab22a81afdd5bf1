"""The launchers as users run them: a real Slurm and a real sshd, on both engines.

``nbdist.start(profile=...)`` with the profiles of ``examples/profiles/`` (``slurm-local.yaml``,
``ssh-localhost.yaml``), pointed at the test daemons of ``realclusters.py``; the ranks must run
where the launcher put them (as tasks of Slurm jobs; in processes an ssh session started), a
2-rank DDP training must equal single-process training on the union batch, and ``stop`` must
leave no job in ``squeue`` and no process of an ssh session within 30 s of being called.

Known gaps are marked ``xfail(strict=True)`` and raise an exception of their own, so that any
other failure of the same test is still a failure: the Dask launchers listen on every
interface, and a profile's launcher options replace nbdist's own instead of merging with them.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import psutil
import pytest
import yaml
from clusters import check_ddp_matches_union_batch
from realclusters import LocalSlurm, LocalSshd, describe, wait_until

import nbdist

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "profiles"
PROFILES = {"slurm": "slurm-local.yaml", "ssh": "ssh-localhost.yaml"}
#: what each launcher needs of the Dask engine, and how it is installed
DASK_PACKAGES = {"slurm": "dask_jobqueue", "ssh": "asyncssh"}
STOP_WITHIN = 30.0  # seconds from stop() until no job or ssh-session process is left

pytestmark = pytest.mark.timeout(480)


class ListensBeyondLoopback(AssertionError):
    """A process of the cluster listens on an address other than loopback."""


class OptionDropped(AssertionError):
    """A launcher option nbdist sets was lost when the profile set another of the same kind."""


# ---------------------------------------------------------------------------------- helpers


class Site:
    """One launcher's test daemons, as the tests need them."""

    def __init__(self, launcher: str, daemons: Any):
        self.launcher = launcher
        self.daemons = daemons

    def options(self, engine: str) -> dict[str, Any]:
        """Launcher options that reach these daemons (what a user's site config would say)."""
        if self.launcher != "ssh":
            return {}
        sshd: LocalSshd = self.daemons
        # The remote hosts are this machine: its interpreter has nbdist and torch.
        opts: dict[str, Any] = {"remote_python": sys.executable}
        if engine == "ipyparallel":
            opts.update(ssh_args=["-F", str(sshd.config)], scp_args=["-F", str(sshd.config)])
        else:  # asyncssh reads OpenSSH's client configuration
            opts["connect_options"] = {"config": [str(sshd.config)]}
        return opts

    def hosts(self) -> Optional[dict[str, int]]:
        return {self.daemons.host: 2} if self.launcher == "ssh" else None

    def check_ranks(self, wheres: list[dict[str, Optional[str]]]) -> None:
        """Each rank runs under this launcher: a task of a queued Slurm job, or a process an
        ssh session of this sshd started."""
        if self.launcher == "slurm":
            jobs = self.daemons.jobs()
            for r, w in enumerate(wheres):
                assert w["SLURM_JOB_ID"] in jobs, f"rank {r} is no task of a Slurm job: {w}"
        else:
            for r, w in enumerate(wheres):
                assert (w["SSH_CONNECTION"] or "").endswith(f" {self.daemons.port}"), \
                    f"rank {r} was not started through the test sshd: {w}"

    def leftovers(self) -> list[str]:
        """Jobs still in squeue, or processes of ssh sessions still running."""
        if self.launcher == "slurm":
            return self.daemons.jobs()
        return [describe(p) for p in self.daemons.sessions()]

    def processes(self) -> list[psutil.Process]:
        if self.launcher == "slurm":
            return self.daemons.processes()
        return self.daemons.sessions()


@pytest.fixture(params=[pytest.param("slurm", marks=pytest.mark.slurm),
                        pytest.param("ssh", marks=pytest.mark.ssh)])
def site(request) -> Site:
    return Site(request.param, request.getfixturevalue(
        "slurm" if request.param == "slurm" else "sshd"))


def write_profile(tmp: Path, site: Site, engine: str, **options: Any) -> Path:
    """The example profile for ``site``'s launcher, on ``engine``, with the options that reach
    the test daemons (and ``options``) added to its ``resources.options``."""
    data = yaml.safe_load((EXAMPLES / PROFILES[site.launcher]).read_text())
    data["cluster"]["engine"] = engine
    if site.hosts():
        data["cluster"]["hosts"] = site.hosts()
    resources = data["cluster"].setdefault("resources", {})
    resources["options"] = {**resources.get("options", {}), **site.options(engine), **options}
    path = tmp / f"{site.launcher}-{engine}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def needs_engine(engine: str, launcher: str) -> None:
    if engine == "dask":
        pytest.importorskip("distributed")
        pytest.importorskip(DASK_PACKAGES[launcher],
                            reason=f"the dask engine's {launcher} launcher needs it")


def open_listeners(procs: list[psutil.Process]) -> list[str]:
    """The TCP listeners of ``procs`` bound to an address other than loopback."""
    pids = {p.pid: p for p in procs}
    out = []
    for c in psutil.net_connections("inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids \
                and not ipaddress.ip_address(c.laddr.ip).is_loopback:
            out.append(f"{c.laddr.ip}:{c.laddr.port} ({describe(pids[c.pid])[:90]})")
    return sorted(out)


def cluster_processes(site: Site) -> list[psutil.Process]:
    """This process (a Dask scheduler may run in it), its children (an ipyparallel
    controller) and the processes the launcher started."""
    me = psutil.Process()
    return [me, *me.children(recursive=True), *site.processes()]


def run_then_stop(site: Site, body: Callable[[], None]) -> tuple[float, float]:
    """Run ``body`` on the started cluster, then stop it and wait until the launcher's daemons
    hold nothing of it; returns (seconds of stop(), seconds until nothing was left)."""
    failed = True
    try:
        body()
        failed = False
    finally:
        t0 = time.monotonic()
        nbdist.stop()
        stopped = time.monotonic() - t0
        try:
            wait_until(lambda: not site.leftovers(), max(0.0, STOP_WITHIN - stopped),
                       f"nothing of the cluster left {STOP_WITHIN:g} s after stop()")
            cleared = time.monotonic() - t0
            if cleared > STOP_WITHIN:  # wait_until passes a condition already true
                raise AssertionError(f"stop() itself took {stopped:.1f} s")
        except AssertionError as exc:
            if not failed:  # else the first failure is the one to report
                raise AssertionError(f"the cluster was not gone {STOP_WITHIN:g} s after "
                                     f"stop() was called: {exc}; left: {site.leftovers()}"
                                     ) from None
            cleared = time.monotonic() - t0
    return stopped, cleared


# ------------------------------------------------------------------------------------ tests

_WHERE = """
import os
where = {k: os.environ.get(k) for k in ("SLURM_JOB_ID", "SLURM_PROCID", "SSH_CONNECTION")}
"""


@pytest.mark.parametrize("engine", [
    "ipyparallel",
    pytest.param("dask", marks=pytest.mark.xfail(
        raises=ListensBeyondLoopback, strict=True,
        reason="dask-jobqueue's dashboard and workers, and SSHCluster's scheduler, dashboard "
               "and workers, listen on every interface: nbdist passes them no host")),
])
def test_profile_starts_trains_and_stops(site, engine, tmp_cwd):
    needs_engine(engine, site.launcher)
    profile = write_profile(tmp_cwd, site, engine)
    t0 = time.monotonic()
    session = nbdist.start(profile=str(profile))
    started = time.monotonic() - t0
    listening: list[str] = []
    trained = [0.0]

    def body() -> None:
        assert session.world_size == 2
        session.run_cell(_WHERE, output="quiet")
        site.check_ranks([session.pull("where", rank=r) for r in range(2)])
        listening.extend(open_listeners(cluster_processes(site)))
        t = time.monotonic()
        check_ddp_matches_union_batch(session)
        trained[0] = time.monotonic() - t

    stopped, cleared = run_then_stop(site, body)
    print(f"{site.launcher} x {engine}: started in {started:.1f} s, trained in "
          f"{trained[0]:.1f} s, stop() {stopped:.1f} s, nothing left after {cleared:.1f} s")
    if listening:
        raise ListensBeyondLoopback("listening beyond loopback: " + "; ".join(listening))


@pytest.mark.slurm
@pytest.mark.xfail(raises=ListensBeyondLoopback, strict=True,
                   reason="launcher options merge shallowly: the profile's scheduler_options "
                          "replace nbdist's, dropping the host that `listen` set")
def test_dask_slurm_scheduler_options_keep_listen(slurm: LocalSlurm, tmp_cwd):
    """A user who moves the dashboard off every interface (``scheduler_options``) must keep the
    scheduler on the `listen` address nbdist puts in the same dict."""
    site = Site("slurm", slurm)
    needs_engine("dask", "slurm")
    profile = write_profile(tmp_cwd, site, "dask",
                            scheduler_options={"dashboard_address": "127.0.0.1:0"})
    nbdist.start(profile=str(profile))
    mine: list[str] = []
    # The scheduler of dask-jobqueue runs in this process.
    run_then_stop(site, lambda: mine.extend(open_listeners([psutil.Process()])))
    if mine:
        raise ListensBeyondLoopback("the scheduler left `listen` (127.0.0.1): " + "; ".join(mine))


@pytest.mark.ssh
@pytest.mark.xfail(raises=OptionDropped, strict=True,
                   reason="launcher options merge shallowly: the profile's worker_options "
                          "replace nbdist's, dropping its one thread per worker")
def test_dask_ssh_worker_options_keep_one_thread(sshd: LocalSshd, tmp_cwd):
    """A user who sets a worker option (``worker_options``) must keep nbdist's own in the
    same dict: one thread per worker, since a rank's cells run one at a time."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("Dask's default is already one thread on a one-core machine")
    site = Site("ssh", sshd)
    needs_engine("dask", "ssh")
    profile = write_profile(tmp_cwd, site, "dask",
                            worker_options={"dashboard_address": "127.0.0.1:0"})
    session = nbdist.start(profile=str(profile))
    threads: list[int] = []

    def body() -> None:
        info = session.backend.client.scheduler_info(n_workers=-1)["workers"]
        threads.extend(w["nthreads"] for w in info.values())

    run_then_stop(site, body)
    assert len(threads) == 2
    if threads != [1, 1]:
        raise OptionDropped(f"workers run {threads} threads, not nbdist's 1")
