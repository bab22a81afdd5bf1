"""A profile reaches Dask's launchers: the cluster class of distributed, dask-jobqueue or
dask-kubernetes with its arguments, the settings its workers start under, a launcher's missing
package named with how to install it. Nothing is started here."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys

import pytest

from nbdist.backends.dask.adapter import DaskBackend
from nbdist.backends.dask.launchers import (
    MALLOC_TRIM,
    _is_main_guard,
    cluster_spec,
    worker_environment,
)
from nbdist.errors import MissingPackageError
from nbdist.options import LaunchOptions
from nbdist.session import Session


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


def test_batch_workers_get_nbdists_dask_settings_through_their_environment():
    import dask.config

    # What a worker's Dask makes of them: its defaults, updated from its environment.
    got = dask.config.update(copy.deepcopy(dask.config.config),
                             dask.config.collect_env(worker_environment()))["distributed"]
    assert got["worker"]["daemon"] is False and got["worker"]["profile"]["enabled"] is False
    spawn = got["nanny"]["pre-spawn-environ"]
    assert spawn[MALLOC_TRIM] is None  # unset: glibc's adaptive threshold stays
    assert spawn["OMP_NUM_THREADS"] == 1


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


def test_importing_dask_jobqueue_keeps_the_kernels_interrupt():
    # dask_jobqueue.runner sets SIGINT to sys.exit at import; a fresh interpreter shows it.
    code = ("import signal\n"
            "from nbdist.backends.dask.launchers import import_cluster_class\n"
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
    from nbdist.backends.dask.launchers import unguarded_main_call

    assert unguarded_main_call() is None  # pytest's __main__ runs its tests under a guard
