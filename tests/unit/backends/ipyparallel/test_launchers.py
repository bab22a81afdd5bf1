"""A profile reaches ipyparallel's own launchers: its launcher classes get the settings (checked
in the batch script ipyparallel itself writes). Nothing is started here."""

from __future__ import annotations

import sys

import ipyparallel as ipp
from ipyparallel.cluster.launcher import SSHEngineSetLauncher

from nbdist.backends.ipyparallel.launchers import launcher_settings
from nbdist.options import LaunchOptions


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
    # and wait for the controller's answer to their registration as long as the start may take
    assert "--IPEngine.timeout=300" in engine


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
    assert launcher.engine_cmd[-2:] == ["ipyparallel.engine", "--IPEngine.timeout=300"]


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


def test_a_whole_command_in_the_profile_is_the_users_own():
    # engine_cmd replaces nbdist's command, never extends it
    traits = launcher_settings(LaunchOptions(launcher="slurm", listen="*", options={
        "engine_cmd": ["/x/python", "-m", "ipyparallel.engine"]}))[0]["config"]
    assert traits["SlurmEngineSetLauncher"]["engine_cmd"] == ["/x/python", "-m",
                                                              "ipyparallel.engine"]
