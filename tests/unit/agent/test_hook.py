"""Who a process of a job is, decided at its start from its environment and command line."""

from __future__ import annotations

import pytest

from nbdist.agent import wire
from nbdist.agent.hook import node_directory, role

LINE = "tcp://127.0.0.1:9/t"


@pytest.mark.parametrize("argv", [["python", "-m", "torch.distributed.run", "train.py"],
                                  ["python", "/env/bin/torchrun", "--nproc_per_node=2", "t.py"],
                                  ["python", "-m", "torch.distributed.launch", "t.py"]])
def test_torchrun_is_the_launcher_even_with_rank_variables_around(argv):
    assert role({wire.ENV: LINE}, argv) == "launcher"
    assert role({wire.ENV: LINE, "RANK": "0"}, argv) == "launcher"


@pytest.mark.parametrize("var", ["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"])
def test_a_process_a_launcher_numbered_is_a_rank(var):
    assert role({wire.ENV: LINE, var: "1"}, ["python", "train.py"]) == "rank"


def test_without_the_variable_or_inside_a_reporting_rank_a_process_does_nothing():
    assert role({"RANK": "0"}, ["python", "-m", "torch.distributed.run", "t.py"]) is None
    assert role({wire.ENV: "", "RANK": "0"}, ["python", "t.py"]) is None
    # a DataLoader worker or any child a reporting rank starts inherits its environment
    assert role({wire.ENV: LINE, "RANK": "0", wire.RANK_ENV: "42"}, ["python", "t.py"]) is None
    assert role({wire.ENV: LINE}, ["python", "tool.py"]) is None


def test_a_node_directory_is_one_per_job_and_token():
    a = wire.parse(LINE)
    b = wire.parse("tcp://127.0.0.1:9/other")
    env1, env2 = {"SLURM_JOB_ID": "1"}, {"SLURM_JOB_ID": "2"}
    assert node_directory(a, env1) == node_directory(a, dict(env1))
    assert len({node_directory(a, env1), node_directory(a, env2), node_directory(b, env1)}) == 3
