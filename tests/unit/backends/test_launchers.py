"""Profiles reach the engines' own launchers: ipyparallel's launcher classes get the settings
(checked in the batch script ipyparallel itself writes), Dask gets the cluster class of
distributed, dask-jobqueue or dask-kubernetes with its arguments. Nothing is started here."""

from __future__ import annotations

import copy
import importlib.util
import logging
import subprocess
import sys

import ipyparallel as ipp
import pytest
from ipyparallel.cluster.launcher import SSHEngineSetLauncher

from nbdist.backends.dask.adapter import DaskBackend
from nbdist.backends.launchers import (
    MALLOC_TRIM,
    _is_main_guard,
    cluster_spec,
    launcher_settings,
    merged,
    worker_environment,
)
from nbdist.errors import MissingPackageError
from nbdist.options import LaunchOptions
from nbdist.session import Session


def engine_launcher(launch: LaunchOptions, tmp_path):
    """The engine launcher ipyparallel would make for ``launch`` (not started)."""
    cluster_kwargs, engine_kwargs = launcher_settings(launch)
    cluster = ipp.Cluster(n=2, controller_ip=launch.listen, profile_dir=str(tmp_path),
                          **cluster_kwargs)
    return cluster.engine_launcher_class(
        work_dir=str(tmp_path), parent=cluster, log=cluster.log,
        profile_dir=str(tmp_path), cluster_id="c1", **engine_kwargs)


def test_local_needs_no_launcher_but_runs_under_the_lifeline():
    cluster_kwargs, engine_kwargs = launcher_settings(LaunchOptions())
    assert engine_kwargs == {} and "engine_launcher_class" not in cluster_kwargs
    config = cluster_kwargs["config"]
    for launcher, module in (("LocalControllerLauncher", "controller"),
                             ("LocalEngineSetLauncher", "engine")):
        cmd = config[launcher][f"{module}_cmd"]
        assert cmd[1:3] == ["-m", "nbdist.runtime.boot.lifeline"]
        assert f"ipyparallel.{module}" in cmd
    # engines import torch while they start, and may start before the controller's file exists
    engine = config["LocalEngineSetLauncher"]["engine_cmd"]
    assert engine[engine.index("ipyparallel.engine") - 1] == "nbdist.runtime.boot.preload"
    assert engine[-1] == "--IPEngine.wait_for_url_file=300"


def test_slurm_settings_land_in_ipyparallels_batch_script(tmp_path):
    launch = LaunchOptions(launcher="slurm", listen="*", queue="gpu", account="proj",
                           walltime="02:00:00", cpus=8, gpus=1)
    launcher = engine_launcher(launch, tmp_path)
    assert type(launcher).__name__ == "SlurmEngineSetLauncher"
    launcher.write_batch_script(4)
    script = open(launcher.batch_file).read()
    for line in ("#SBATCH --ntasks=4", "#SBATCH --partition=gpu", "#SBATCH --account=proj",
                 "#SBATCH --time=02:00:00", "#SBATCH --cpus-per-task=8",
                 "#SBATCH --gpus-per-task=1", "srun "):
        assert line in script


def test_pbs_resources_are_one_select_line(tmp_path):
    launch = LaunchOptions(launcher="pbs", listen="*", queue="q", account="a", cpus=4, gpus=1,
                           memory="16gb", walltime="1:00:00")
    launcher = engine_launcher(launch, tmp_path)
    launcher.write_batch_script(2)
    script = open(launcher.batch_file).read()
    for line in ("#PBS -q q", "#PBS -A a", "#PBS -l walltime=1:00:00",
                 "#PBS -l select=1:ncpus=4:ngpus=1:mem=16gb"):
        assert line in script


def test_ssh_hosts_and_the_profiles_own_launcher_options(tmp_path):
    launch = LaunchOptions(launcher="ssh", listen="10.0.0.5", hosts={"node1": 2, "node2": 1},
                           options={"remote_python": "/opt/py/bin/python", "delay": 0.5})
    launcher = engine_launcher(launch, tmp_path)
    assert isinstance(launcher, SSHEngineSetLauncher)  # nbdist's, which stops engines faster
    assert launcher.engines == {"node1": 2, "node2": 1}
    assert launcher.remote_python == "/opt/py/bin/python" and launcher.delay == 0.5
    # On the hosts, engines run that Python under the controller's lifeline.
    assert launcher.engine_cmd[:5] == ["/opt/py/bin/python", "-m",
                                       "nbdist.runtime.boot.lifeline", "--remote",
                                       "nbdist.runtime.boot.preload"]


def test_remote_engines_run_the_notebooks_python_unless_told(tmp_path):
    launch = LaunchOptions(launcher="ssh", listen="10.0.0.5", hosts={"node1": 1})
    launcher = engine_launcher(launch, tmp_path)
    assert launcher.remote_python == sys.executable == launcher.engine_cmd[0]


def test_the_controller_always_runs_under_the_kernels_lifeline(tmp_path):
    for launch in (LaunchOptions(launcher="slurm", listen="*"),
                   LaunchOptions(launcher="ssh", listen="h", hosts={"a": 1})):
        config = launcher_settings(launch)[0]["config"]
        cmd = config["LocalControllerLauncher"]["controller_cmd"]
        assert cmd[1:3] == ["-m", "nbdist.runtime.boot.lifeline"] and cmd[-1] == \
            "ipyparallel.controller"


def test_batch_scripts_go_to_the_clusters_directory(tmp_path):
    cluster_kwargs, engine_kwargs = launcher_settings(
        LaunchOptions(launcher="slurm", listen="*"), cluster_dir=str(tmp_path / "c"))
    traits = cluster_kwargs["config"]["SlurmEngineSetLauncher"]
    assert traits["batch_file_name"] == str(tmp_path / "c" / "slurm_engine.sh")
    assert traits["engine_cmd"][2:4] == ["nbdist.runtime.boot.lifeline", "--remote"]


def test_mpi_is_ipyparallels_mpi_launcher(tmp_path):
    launch = LaunchOptions(launcher="mpi", listen="*", options={"mpi_args": ["--oversubscribe"]})
    launcher = engine_launcher(launch, tmp_path)
    assert type(launcher).__name__ == "MPIEngineSetLauncher"
    assert launcher.mpi_args == ["--oversubscribe"]


def test_dask_ssh_runs_the_scheduler_here_on_listen():
    module, name, package, kwargs, scale = cluster_spec(
        LaunchOptions(launcher="ssh", listen="127.0.0.1", hosts={"a": 2, "b": 1}), 3)
    assert (module, name, package, scale) == ("nbdist.backends.dask.ssh", "SSHWorkers",
                                              "asyncssh", False)
    assert kwargs["hosts"] == {"a": 2, "b": 1} and kwargs["listen"] == "127.0.0.1"
    assert kwargs["scheduler_options"] == {"host": "127.0.0.1",
                                           "dashboard_address": "127.0.0.1:0"}
    assert kwargs["worker_options"]["nthreads"] == 1


def test_dask_jobqueue_one_worker_process_per_job():
    launch = LaunchOptions(launcher="slurm", listen="*", queue="gpu", account="p", cpus=8,
                           memory="32GB", gpus=1, walltime="01:00:00",
                           options={"interface": "ib0", "processes": 1})
    module, name, package, kwargs, scale = cluster_spec(launch, 4, cluster_dir="/d")
    assert (module, name, package, scale) == ("dask_jobqueue", "SLURMCluster", "dask-jobqueue",
                                              True)
    prologue = kwargs.pop("job_script_prologue")
    assert any(line.startswith("export DASK_DISTRIBUTED__WORKER__DAEMON=") for line in prologue)
    assert kwargs == {"processes": 1, "cores": 8, "memory": "32GB", "queue": "gpu",
                      "account": "p", "walltime": "01:00:00", "death_timeout": 60,
                      "job_extra_directives": ["--gres=gpu:1"], "log_directory": "/d",
                      # an interface names the address: no host beside it
                      "scheduler_options": {"dashboard_address": ":0"}, "interface": "ib0",
                      "worker_extra_args": ["--preload", "nbdist.runtime.boot.lifeline"]}
    assert cluster_spec(LaunchOptions(launcher="pbs", listen="h"), 2)[1] == "PBSCluster"


@pytest.mark.parametrize("listen, host", [
    ("127.0.0.1", "127.0.0.1"), ("*", None),
    ("10.1.2.3", f"$({sys.executable} -m nbdist.runtime.boot.route 10.1.2.3)")])
def test_jobqueue_workers_bind_what_listen_says(listen, host):
    args = cluster_spec(LaunchOptions(launcher="slurm", listen=listen), 2)[3]["worker_extra_args"]
    if host is None:  # every interface, as asked
        assert "--host" not in args
    else:
        assert args[args.index("--host") + 1] == host
        assert args[args.index("--dashboard-address") + 1] == f"{host}:0"


def test_profile_options_add_to_nbdists_never_drop_them():
    launch = LaunchOptions(launcher="slurm", listen="127.0.0.1", gpus=1, options={
        "scheduler_options": {"dashboard_address": ":8787"},
        "job_extra_directives": ["--comment=x"], "worker_extra_args": ["--resources", "G=1"]})
    kwargs = cluster_spec(launch, 2)[3]
    assert kwargs["scheduler_options"] == {"host": "127.0.0.1", "dashboard_address": ":8787"}
    assert kwargs["job_extra_directives"] == ["--gres=gpu:1", "--comment=x"]
    assert kwargs["worker_extra_args"][:2] == ["--host", "127.0.0.1"]
    assert kwargs["worker_extra_args"][-2:] == ["--resources", "G=1"]
    ssh = cluster_spec(LaunchOptions(launcher="ssh", listen="127.0.0.1", hosts={"a": 1},
                                     options={"worker_options": {"memory_limit": "4GB"}}), 1)
    assert ssh[3]["worker_options"]["nthreads"] == 1
    assert ssh[3]["worker_options"]["memory_limit"] == "4GB"
    # A whole command is the user's own.
    traits = launcher_settings(LaunchOptions(launcher="slurm", listen="*", options={
        "engine_cmd": ["/x/python", "-m", "ipyparallel.engine"]}))[0]["config"]
    assert traits["SlurmEngineSetLauncher"]["engine_cmd"] == ["/x/python", "-m",
                                                              "ipyparallel.engine"]


def test_merged_is_deep_and_leaves_its_arguments_alone():
    base = {"a": {"x": 1, "l": [1]}, "b": [1, 2], "c": 1}
    over = {"a": {"y": 2, "l": [2]}, "b": [2, 3], "c": 2, "d": 4}
    assert merged(base, over) == {"a": {"x": 1, "y": 2, "l": [1, 2]}, "b": [1, 2, 3], "c": 2,
                                  "d": 4}
    assert base == {"a": {"x": 1, "l": [1]}, "b": [1, 2], "c": 1}


def test_batch_workers_get_nbdists_dask_settings_through_their_environment():
    import dask.config

    # What a worker's Dask makes of them: its defaults, updated from its environment.
    got = dask.config.update(copy.deepcopy(dask.config.config),
                             dask.config.collect_env(worker_environment()))["distributed"]
    assert got["worker"]["daemon"] is False and got["worker"]["profile"]["enabled"] is False
    spawn = got["nanny"]["pre-spawn-environ"]
    assert spawn[MALLOC_TRIM] is None  # unset: glibc's adaptive threshold stays
    assert spawn["OMP_NUM_THREADS"] == 1


def test_ssh_replacements_go_to_the_host_short_of_its_share():
    from nbdist.backends.dask.ssh import SSHWorkers

    class Fake:
        hosts = {"a": 2, "b": 2}
        _avoid: frozenset = frozenset()
        worker_spec = {0: {"options": {"address": "a"}}, 1: {"options": {"address": "a"}},
                       3: {"options": {"address": "b"}}}

        def _spec(self, host):
            return {"options": {"address": host}}

    assert SSHWorkers.new_worker_spec(Fake()) == {4: {"options": {"address": "b"}}}


def test_dask_kubernetes_pods_with_limits():
    launch = LaunchOptions(launcher="kubernetes", image="img:1", cpus=4, memory="8Gi", gpus=1,
                           options={"namespace": "ml"})
    module, name, package, kwargs, scale = cluster_spec(launch, 4, "nbdist-abc")
    assert (module, name, package, scale) == ("dask_kubernetes.operator", "KubeCluster",
                                              "dask-kubernetes", False)
    limits = {"cpu": "4", "memory": "8Gi", "nvidia.com/gpu": "1"}
    assert kwargs == {"name": "nbdist-abc", "n_workers": 4, "image": "img:1",
                      "resources": {"limits": limits, "requests": limits}, "namespace": "ml"}


@pytest.fixture
def no_jobqueue(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "dask_jobqueue" else real(name, *a))


def test_missing_launcher_package_is_named_and_nothing_starts(no_jobqueue):
    backend = DaskBackend()
    backend.launch = LaunchOptions(launcher="slurm", listen="*")
    with pytest.raises(MissingPackageError, match=r"'slurm' launcher needs the "
                                                  r"`dask-jobqueue` package.*pip install "
                                                  r"'nbdist\[slurm\]' \(or pip install "
                                                  r"dask-jobqueue\)"):
        backend.start(2, 5)
    assert backend.client is None and backend.cluster is None


def test_missing_package_from_a_profile_leaves_the_session_stopped(no_jobqueue, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("cluster: {engine: dask, launcher: slurm, listen: '*', workers: 2}\n")
    session = Session()
    with pytest.raises(MissingPackageError, match="pip install dask-jobqueue"):
        session.start(profile=path)
    assert session.backend is None and not session.running


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


def test_importing_dask_jobqueue_keeps_the_kernels_interrupt():
    # dask_jobqueue.runner sets SIGINT to sys.exit at import; a fresh interpreter shows it.
    code = ("import signal\n"
            "from nbdist.backends.launchers import import_cluster_class\n"
            "import_cluster_class('dask_jobqueue', 'SLURMCluster', 'dask-jobqueue', 'slurm')\n"
            "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n"
            "import dask_jobqueue.runner\n")  # already imported: the handler stays
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize("source, guard", [
    ('if __name__ == "__main__":\n    main()', True),
    ("if '__main__' == __name__:\n    main()", True),
    ('if __name__ == "__main__" and not quiet:\n    main()', True),
    ("main()", False),
    ('if __name__ != "x":\n    main()', False),
    ("if debug:\n    main()", False),
])
def test_a_main_guard_is_told_from_other_top_level_statements(source, guard):
    import ast

    assert _is_main_guard(ast.parse(source).body[0]) is guard


def test_a_call_under_pytest_s_guarded_main_is_not_refused():
    from nbdist.backends.launchers import unguarded_main_call

    assert unguarded_main_call() is None  # pytest's __main__ runs its tests under a guard


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
