"""Who a process of a job is, decided at its start from its environment and command line."""

from __future__ import annotations

import pytest

from nbdist.agent import wire
from nbdist.agent.hook import node_directory, role
from nbdist.agent.rank import identity

LINE = "tcp://127.0.0.1:9/t"


@pytest.mark.parametrize("argv", [["python", "-m", "torch.distributed.run", "train.py"],
                                  ["python", "/env/bin/torchrun", "--nproc_per_node=2", "t.py"],
                                  ["python", "-m", "torch.distributed.launch", "t.py"]])
def test_torchrun_is_the_launcher_even_with_rank_variables_around(argv):
    assert role({wire.ENV: LINE}, argv) == "launcher"
    assert role({wire.ENV: LINE, "RANK": "0"}, argv) == "launcher"


@pytest.mark.parametrize("env", [{"RANK": "1"}, {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0"},
                                 {"OMPI_COMM_WORLD_RANK": "1"}, {"PMI_RANK": "1"}])
def test_a_process_a_launcher_numbered_is_a_rank(env):
    assert role({wire.ENV: LINE, **env}, ["python", "train.py"]) == "rank"


# What Slurm 22-24 put in a 3-task batch job's script and in the tasks of its
# `srun --ntasks=2` step (seen with `env` in the suite's Slurm).
BATCH = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "3"}
TASK_1 = {**BATCH, "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
          "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2"}


def test_an_srun_task_is_a_rank_numbered_as_srun_numbers_it_and_its_step_is_the_job():
    assert role({wire.ENV: LINE, **TASK_1}, ["python", "train.py"]) == "rank"
    assert identity(TASK_1) == {"rank": 1, "world_size": 2, "local_rank": 1, "restart": 0}
    assert wire.job_key(TASK_1) == "slurm-7.0"


# What Debian's Open MPI 4.1 puts in rank 1 of `mpirun -np 2 python train.py` (seen with
# `env`; of the rest, nothing names the rank or the job): the ranks of one mpirun share the
# PMIx namespace, on every host
MPI_1 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
         "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
         "OMPI_COMM_WORLD_NODE_RANK": "1", "PMIX_RANK": "1", "PMIX_NAMESPACE": "901971969",
         "PMIX_ID": "901971969.1", "OMPI_MCA_ess_base_jobid": "901971969",
         "OMPI_MCA_orte_hnp_uri": "901971968.0;tcp://192.0.2.2:35929"}


def test_an_mpirun_rank_is_numbered_as_open_mpi_numbers_it_and_its_namespace_is_the_job():
    assert role({wire.ENV: LINE, **MPI_1}, ["python", "train.py"]) == "rank"
    assert identity(MPI_1) == {"rank": 1, "world_size": 2, "local_rank": 1, "restart": 0}
    assert wire.job_key(MPI_1) == "mpirun-901971969"
    rank_0 = {**MPI_1, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
              "PMIX_RANK": "0", "PMIX_ID": "901971969.0"}
    address = wire.parse(LINE)
    assert node_directory(address, rank_0) == node_directory(address, MPI_1)  # one election
    other = {**MPI_1, "PMIX_NAMESPACE": "901971970"}  # the next mpirun
    assert node_directory(address, other) != node_directory(address, MPI_1)


def test_a_batch_scripts_own_python_is_not_a_rank_of_the_job():
    """Slurm sets SLURM_PROCID=0 in the batch script too: a Python run there (to prepare data,
    or a batch script written in Python that calls srun) is no rank, and its children, the
    srun step's tasks, are not silenced by it."""
    assert role({wire.ENV: LINE, **BATCH}, ["python", "prepare.py"]) is None
    assert role({wire.ENV: LINE, **BATCH}, ["python", "-m", "torch.distributed.run",
                                            "train.py"]) == "launcher"


def test_without_the_variable_or_inside_a_reporting_rank_a_process_does_nothing():
    assert role({"RANK": "0"}, ["python", "-m", "torch.distributed.run", "t.py"]) is None
    assert role({wire.ENV: "", "RANK": "0"}, ["python", "t.py"]) is None
    # a DataLoader worker or any child a reporting rank starts inherits its environment
    assert role({wire.ENV: LINE, "RANK": "0", wire.RANK_ENV: "42"}, ["python", "t.py"]) is None
    assert role({wire.ENV: LINE}, ["python", "tool.py"]) is None


def test_a_nbdist_run_scripts_process_is_a_rank_without_a_notebook_address_its_children_not():
    env = {wire.RUN_SPOOL_ENV: "/tmp/spool", "RANK": "1"}
    assert role(env, ["python", "-m", "nbdist.agent", "t.py"]) == "rank"
    assert role({**env, wire.RANK_ENV: "42"}, ["python", "-c", "worker"]) is None


def test_a_node_directory_is_one_per_job_and_token():
    a = wire.parse(LINE)
    b = wire.parse("tcp://127.0.0.1:9/other")
    env1, env2 = {"SLURM_JOB_ID": "1"}, {"SLURM_JOB_ID": "2"}
    assert node_directory(a, env1) == node_directory(a, dict(env1))
    assert len({node_directory(a, env1), node_directory(a, env2), node_directory(b, env1)}) == 3


def test_a_rank_that_takes_over_forwarding_writes_its_own_end_before_its_forwarder_closes(
        monkeypatch, tmp_path):
    """atexit runs the last-registered first: a rank that became its node's forwarder after
    its agent started must have its end run before the forwarder's close, which waits for
    every rank's end (its own included) and then says bye."""
    import atexit

    from nbdist.agent import forwarder, hook

    order: list = []

    class Agent:
        def end(self):
            order.append("end")

    class Forwarder:
        def __init__(self, address, directory):
            pass

        def start(self):
            return self

        def close(self, wait_for_ranks=0.0):
            order.append("close")

    agent = Agent()
    registered: list = []
    monkeypatch.setattr(atexit, "register", lambda f, *a: registered.append((f, a)))
    monkeypatch.setattr(atexit, "unregister",
                        lambda f: registered[:] and registered.remove(
                            next(r for r in registered if r[0] == f)))
    monkeypatch.setattr(forwarder, "Forwarder", Forwarder)
    monkeypatch.setattr(hook, "rank_agent", lambda: agent)
    registered.append((agent.end, ()))  # the agent started first, as a rank's does
    hook._forward(wire.parse(LINE), str(tmp_path))
    for f, a in reversed(registered):  # as Python runs them at exit
        f(*a)
    assert order == ["end", "close"]
