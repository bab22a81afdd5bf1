"""Which mesh dimension a process group serves (:mod:`nbdist.runtime.mesh`), so that
telemetry can name it; and ``nbdist.mesh()`` outside a cell."""

from __future__ import annotations

import pytest

from nbdist.runtime import mesh


class FakeMesh:
    def __init__(self, names, groups):
        self.mesh_dim_names = names
        self._dim_group_names = groups


def test_mesh_dimensions_are_named_from_pairs_meshes_and_remembered_groups():
    two_d = FakeMesh(("dp", "tp"), ["g1", "g2"])
    mesh.remember(two_d)
    assert mesh.dim_of((two_d, 1)) == "tp" and mesh.dim_of((two_d, "dp")) == "dp"
    assert mesh.dim_of(FakeMesh(("tp",), ["g2"])) == "tp"
    assert mesh.dim_of("g1") == "dp" and mesh.dim_of(None) is None
    assert mesh.dim_of("unknown") is None
    mesh.remember(FakeMesh(None, ["g9"]))
    assert mesh.dim_of("g9") == "dim0"


def test_a_group_object_is_read_by_its_name_and_the_latest_mesh_wins():
    class Group:
        group_name = "g21"

    mesh.remember(FakeMesh(("dp", "tp"), ["g20", "g21"]))
    assert mesh.dim_of(Group()) == "tp"
    mesh.remember(FakeMesh(("pp",), ["g21"]))  # a later mesh over the same group
    assert mesh.dim_of(Group()) == "pp"
    assert mesh.dim_of(FakeMesh(("dp", "tp"), ["g20", "g21"])) is None  # 2-D: no one name
    mesh.remember(FakeMesh(("x",), []))  # a mesh whose groups are not made yet: nothing
    assert mesh.dim_of("x") is None


def test_the_mesh_needs_the_process_group_of_a_cell():
    with pytest.raises(RuntimeError, match="%%distributed"):
        mesh.mesh(dp=2)
