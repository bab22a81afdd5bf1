"""Pure option parsing: rank selections and option records."""

import pytest

from nbdist.options import CellOptions, ClusterOptions, parse_ranks


@pytest.mark.parametrize("spec,world,expected", [
    (None, 3, (0, 1, 2)),
    ("all", 2, (0, 1)),
    ("1", 2, (1,)),
    ("0,2-3", 4, (0, 2, 3)),
    (" 3 , 1-2 ", 4, (1, 2, 3)),
    ("1,1,0-1", 2, (0, 1)),
])
def test_parse_ranks(spec, world, expected):
    assert parse_ranks(spec, world) == expected


@pytest.mark.parametrize("spec,world,message", [
    ("2", 2, "out of range"),
    ("a", 2, "bad rank selection"),
    ("3-1", 4, "start is after end"),
    ("-1", 2, "bad rank selection"),
    (",", 2, "selects no rank"),
    ("0; import os", 2, "bad rank selection"),
])
def test_parse_ranks_rejects(spec, world, message):
    with pytest.raises(ValueError, match=message):
        parse_ranks(spec, world)


def test_cluster_options_validate():
    assert ClusterOptions(n=4).n == 4
    with pytest.raises(ValueError, match="engine"):
        ClusterOptions(engine="ray")
    with pytest.raises(ValueError, match="-n must be at least 1"):
        ClusterOptions(n=0)
    with pytest.raises(ValueError, match="positive"):
        ClusterOptions(timeout=0)
    with pytest.raises(ValueError, match="nccl needs"):
        ClusterOptions(device="cpu", dist_backend="nccl")


def test_cell_options_validate():
    assert CellOptions(output="all").output == "all"
    with pytest.raises(ValueError, match="output mode"):
        CellOptions(output="loud")
    with pytest.raises(ValueError, match="positive"):
        CellOptions(timeout=-1)
