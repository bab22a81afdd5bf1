"""The launchers as users run them: a real Slurm and a real sshd, on both engines.

``nbdist.start(profile=...)`` with the profiles of ``examples/profiles/`` (``slurm-local.yaml``,
``ssh-localhost.yaml``), pointed at the test daemons of ``realclusters.py``; the ranks must run
where the launcher put them (as tasks of Slurm jobs; in processes an ssh session started), a
2-rank DDP training must equal single-process training on the union batch, every listener of
the cluster must be on loopback (the profiles' ``listen``), and ``stop`` must leave no job in
``squeue``, no process of an ssh session and no file of the cluster within 30 s of being
called. The profiles add options of the same kind nbdist sets itself, which must add to
nbdist's, never replace them. A host that cannot run the workers is named before anything
starts.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import psutil
import pytest
import yaml
from clusters import check_ddp_matches_union_batch
from realclusters import (
    Site,
    free_port,
    needs_engine,
    open_listeners,
    wait_until,
    write_profile,
)

import nbdist
from nbdist.errors import LaunchFailed, OptionError

STOP_WITHIN = 30.0  # seconds from stop() until no job or ssh-session process is left

pytestmark = pytest.mark.timeout(300)


def cluster_processes(site: Site) -> list[psutil.Process]:
    """This process (a Dask scheduler runs in it), its children (an ipyparallel controller)
    and the processes the launcher started."""
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


#: options a user might add, of the kinds nbdist sets itself (which they must not drop)
USER_OPTIONS = {
    ("slurm", "dask"): {"scheduler_options": {"idle_timeout": "1h"},
                        "worker_extra_args": ["--resources", "TEST=1"],
                        "job_extra_directives": ["--comment=nbdist-test"]},
    ("ssh", "dask"): {"scheduler_options": {"idle_timeout": "1h"},
                      "worker_options": {"resources": {"TEST": 1}}},
    ("slurm", "ipyparallel"): {},
    ("ssh", "ipyparallel"): {},
}

_WHERE = """
import os
where = {k: os.environ.get(k) for k in ("SLURM_JOB_ID", "SLURM_PROCID", "SSH_CONNECTION")}
"""


@pytest.mark.parametrize("engine", ["ipyparallel", "dask"])
def test_profile_starts_trains_and_stops(site, engine, tmp_cwd, cluster_dirs):
    needs_engine(engine, site.launcher)
    profile = write_profile(tmp_cwd, site, engine, **USER_OPTIONS[site.launcher, engine])
    t0 = time.monotonic()
    session = nbdist.start(profile=str(profile))
    started = time.monotonic() - t0
    trained = [0.0]

    def body() -> None:
        assert session.world_size == 2
        session.run_cell(_WHERE, output="quiet")
        site.check_ranks([session.pull("where", rank=r) for r in range(2)])
        assert not open_listeners(cluster_processes(site)), \
            "listening beyond loopback, though the profile's listen is 127.0.0.1"
        if engine == "dask":  # nbdist's own options held beside the user's
            client = session.backend.client
            workers = client.scheduler_info(n_workers=-1)["workers"].values()
            assert [w["nthreads"] for w in workers] == [1, 1]
            assert all(w["resources"] == {"TEST": 1} for w in workers), list(workers)
            assert client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.idle_timeout
                                           ) == 3600
        t = time.monotonic()
        check_ddp_matches_union_batch(session)
        trained[0] = time.monotonic() - t
        # The cluster's files (where it has any here: Dask over SSH has none) are in its own
        # directory, not the notebook's.
        assert {p.name for p in tmp_cwd.iterdir()} - {"clusters"} == {profile.name}

    stopped, cleared = run_then_stop(site, body)
    print(f"{site.launcher} x {engine}: started in {started:.1f} s, trained in "
          f"{trained[0]:.1f} s, stop() {stopped:.1f} s, nothing left after {cleared:.1f} s")
    assert not cluster_dirs.exists() or not list(cluster_dirs.iterdir()), \
        "the cluster's directory was not removed"


@pytest.mark.ssh
@pytest.mark.parametrize("engine", ["ipyparallel", "dask"])
def test_a_host_that_cannot_run_workers_is_named_and_nothing_starts(sshd, engine, tmp_cwd,
                                                                    cluster_dirs):
    site = Site("ssh", sshd)
    needs_engine(engine, "ssh")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.monotonic()
    with pytest.raises(OptionError) as info:
        nbdist.start(profile=str(write_profile(tmp_cwd, site, engine,
                                               remote_python="/nonexistent/bin/python")))
    text = str(info.value)
    assert sshd.host in text and "cluster.resources.options.remote_python" in text, text
    # A host out of reach (its alias points where nothing listens).
    config = sshd.base / "ssh_config_unreachable"
    config.write_text(f"Host nbdist-unreachable\n  HostName 127.0.0.1\n  Port {free_port()}\n"
                      f"  IdentityFile {sshd.user_key}\n  BatchMode yes\n"
                      "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n")
    profile = write_profile(tmp_cwd, site, engine)
    data = yaml.safe_load(profile.read_text())
    data["cluster"]["hosts"] = {"nbdist-unreachable": 2}
    data["cluster"]["resources"]["options"] = (
        {"ssh_args": ["-F", str(config)]} if engine == "ipyparallel"
        else {"connect_options": {"config": [str(config)]}})
    profile.write_text(yaml.safe_dump(data))
    with pytest.raises(LaunchFailed, match="cannot run a command on nbdist-unreachable over SSH"):
        nbdist.start(profile=str(profile))
    assert time.monotonic() - t0 < 60
    assert not site.leftovers()
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    assert not nbdist.current_session().running


@pytest.mark.ssh
def test_engines_that_exit_at_start_are_reported_at_once_with_their_logs(sshd, tmp_cwd,
                                                                         cluster_dirs):
    """Their Python passes the check, but the engine command fails on the host: the start
    ends as soon as too few engines are left, with the end of their logs, not after the
    whole --timeout; nothing is left running."""
    wrapper = tmp_cwd / "python"
    wrapper.write_text("#!/bin/sh\ncase \"$*\" in *ipyparallel.engine*)\n"
                       "  echo 'engine: cannot start here' >&2; exit 1;;\nesac\n"
                       f"exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    site = Site("ssh", sshd)
    profile = write_profile(tmp_cwd, site, "ipyparallel", remote_python=str(wrapper))
    t0 = time.monotonic()
    with pytest.raises(LaunchFailed, match=r"exited before they registered") as info:
        nbdist.start(profile=str(profile))
    assert "engine: cannot start here" in str(info.value)
    assert time.monotonic() - t0 < 90  # the profile's timeout is 120 s
    wait_until(lambda: not site.leftovers(), 30, "nothing left on the host")
