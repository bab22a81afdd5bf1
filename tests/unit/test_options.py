"""Pure option parsing: rank selections and option records."""

from typing import get_args, get_type_hints

import pytest

from nbdist.backends.registry import engines
from nbdist.errors import OptionError
from nbdist.options import (
    DEVICES,
    DIST_BACKENDS,
    ENGINES,
    LAUNCHERS,
    CellDefaults,
    CellOptions,
    ClusterOptions,
    LaunchOptions,
    parse_ranks,
)


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


def test_hosts_place_the_workers():
    ssh = LaunchOptions(launcher="ssh", listen="10.0.0.1", hosts={"a": 2, "b": 1})
    assert ClusterOptions(launch=ssh).n == 3
    assert ClusterOptions(n=2, launch=ssh).n == 2


@pytest.mark.parametrize("make,message", [
    (lambda: LaunchOptions(launcher="slurmm"), "unknown launcher"),
    (lambda: LaunchOptions(cpus=0), "cpus per worker must be at least 1"),
    (lambda: LaunchOptions(gpus=-1), "gpus per worker must be at least 0"),
    (lambda: LaunchOptions(launcher="ssh", hosts={"a": 0}), "host 'a' must be at least 1"),
    (lambda: CellDefaults(elastic_max_failures=-1), "max_failures must be at least 0"),
    (lambda: CellDefaults(output="loud"), "output mode"),
])
def test_records_refuse_values_out_of_range(make, message):
    with pytest.raises(OptionError, match=message):
        make()


def test_choices_are_the_fields_literal_types_and_the_registered_engines():
    hints = get_type_hints(ClusterOptions)
    assert get_args(hints["device"]) == DEVICES and get_args(hints["dist_backend"]) == DIST_BACKENDS
    # engines and their launchers are the registered ones; the first is the default
    assert ENGINES == ("ipyparallel", "dask") and ClusterOptions().engine == "ipyparallel"
    assert set(LAUNCHERS) == {name for e in engines() for name in e.launchers}
    assert LaunchOptions(launcher="kubernetes").launcher in LAUNCHERS
