"""``nbdist``'s public names stay what they are after every module of the package is imported.

A subpackage named like a public function (``nbdist/export/`` beside ``nbdist.export()``) would
replace the function on the package the moment anything imports it; this catches such a room.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import nbdist

MODULES_BY_DESIGN = {"elastic"}  # nbdist.elastic is the package users import


def test_every_public_name_survives_importing_every_module():
    before = {name: getattr(nbdist, name) for name in nbdist.__all__
              if name not in MODULES_BY_DESIGN}
    for info in pkgutil.walk_packages(nbdist.__path__, "nbdist."):
        if ".runtime.boot." in info.name and info.name.endswith(("forkserver", "store_host")):
            continue  # process entry points: importing them starts their process's work
        importlib.import_module(info.name)
    for name, value in before.items():
        now = getattr(nbdist, name)
        assert now is value, f"nbdist.{name} became {now!r} once nbdist's modules were imported"
        assert not inspect.ismodule(now), f"nbdist.{name} is a module"


def test_dir_offers_the_public_names_not_the_typing_ones():
    """Tab completion (``dir``) lists every public name, those loaded on first use too, and
    none of the typing names the package imports for itself."""
    names = dir(nbdist)
    assert names == sorted(nbdist.__all__)
    assert {"progress", "log", "mesh", "ParameterServer", "attach", "jobs"} <= set(names)
    assert not {"Any", "Optional", "Sequence", "TYPE_CHECKING", "sys", "annotations"} & set(names)
