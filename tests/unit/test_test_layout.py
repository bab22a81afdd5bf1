"""The tests mirror the package, so the test of a module is found by its path alone.

``nbdist/<folder>/<module>.py`` is tested in ``tests/unit/<folder>/test_<module>.py`` (and in
``tests/integration/<folder>/`` where it needs real clusters); a test that looks at one side of a
module has the module's name first: ``test_<module>_<aspect>.py``. A folder's ``__init__.py`` is
tested under the folder's own name (``tests/unit/magics/test_magics.py``). Tests of the whole
package or of the repository (import rules, public names, the docs) lie directly in
``tests/unit/`` or ``tests/integration/``, beside the tests of the top-level modules. At least
70 % of the modules have a test file named after them (the count and its rule are below).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nbdist"
LAYERS = [ROOT / "tests" / "unit", ROOT / "tests" / "integration"]


def folders() -> set[Path]:
    """The package's folders, relative to ``nbdist/``: those with an ``__init__.py`` (a folder
    left with only ``__pycache__`` after a move is not one)."""
    return {p.parent.relative_to(PACKAGE) for p in PACKAGE.rglob("__init__.py")}


def names_in(folder: Path) -> set[str]:
    """What a test file in ``folder`` may be named after: its modules and, for its
    ``__init__.py``, the folder's own name."""
    names = {p.stem for p in (PACKAGE / folder).glob("*.py") if p.stem != "__init__"}
    if folder != Path("."):
        names.add(folder.name)
    return names


def named_after(stem: str, names: set[str]) -> bool:
    """``test_<name>.py`` or ``test_<name>_<aspect>.py`` for one of ``names``."""
    subject = stem.removeprefix("test_")
    return any(subject == n or subject.startswith(n + "_") for n in names)


def every_test_file() -> list[Path]:
    return sorted(p for layer in LAYERS for p in layer.rglob("test_*.py"))


def test_every_test_file_lies_in_a_folder_of_the_package_and_names_one_of_its_modules():
    package = folders()
    misplaced = []
    for path in every_test_file():
        layer = next(lay for lay in LAYERS if lay in path.parents)
        folder = path.parent.relative_to(layer)
        if folder == Path("."):
            continue
        if folder not in package:
            misplaced.append(f"{path.relative_to(ROOT)}: there is no nbdist/{folder}/")
        elif not named_after(path.stem, names_in(folder)):
            misplaced.append(f"{path.relative_to(ROOT)}: nbdist/{folder}/ has no module "
                             f"{path.stem.removeprefix('test_')}.py (test_<module>[_<aspect>].py)")
    assert not misplaced, "test files outside the mirror of nbdist/:\n" + "\n".join(misplaced)


def test_a_test_at_the_top_named_after_a_module_in_a_folder_lies_in_that_folder():
    top = names_in(Path("."))
    elsewhere = {}
    for folder in folders() - {Path(".")}:
        for name in names_in(folder) - {folder.name}:
            elsewhere.setdefault(name, []).append(folder)
    misplaced = []
    for path in every_test_file():
        if path.parent not in LAYERS or named_after(path.stem, top):
            continue
        homes = [f"{path.parent.relative_to(ROOT)}/{folder}/"
                 for name, where in elsewhere.items() if named_after(path.stem, {name})
                 for folder in where]
        if homes:
            misplaced.append(f"{path.relative_to(ROOT)} belongs in {' or '.join(sorted(homes))}")
    assert not misplaced, "\n".join(misplaced)


def test_the_layout_rules_catch_a_misplaced_file():
    package = folders()
    assert Path("telemetry") in package and Path("runtime/measure") in package
    assert Path("telemetry/__pycache__") not in package
    assert named_after("test_aggregate", names_in(Path("telemetry")))
    assert named_after("test_aggregate_scale", names_in(Path("telemetry")))
    assert not named_after("test_aggregates", names_in(Path("telemetry")))
    assert named_after("test_magics", names_in(Path("magics")))
    assert not named_after("test_aggregate", names_in(Path(".")))
    assert named_after("test_session_lifecycle", names_in(Path(".")))


#: the least share of the package's modules that have a test file named after them
NAMED_AT_LEAST = 0.70


def modules() -> list[Path]:
    """Every module of the package, as the figure below counts them: each ``nbdist/**/*.py``
    except ``__init__.py`` (a folder's, tested under the folder's name) and ``_version.py``
    (written by the build)."""
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts
                  and p.name not in ("__init__.py", "_version.py"))


def has_a_test_named_after_it(module: Path) -> bool:
    """``tests/unit/<folder>/test_<module>.py`` or ``test_<module>_<aspect>.py``, or the same
    under ``tests/integration/``."""
    folder = module.parent.relative_to(PACKAGE)
    return any(named_after(t.stem, {module.stem})
               for layer in LAYERS for t in (layer / folder).glob("test_*.py"))


def test_most_modules_have_a_test_file_named_after_them():
    """At least 70 % of the modules have a test file named after them. Counted: every
    ``nbdist/**/*.py`` but ``__init__.py`` and ``_version.py``, each once; a module counts when
    ``tests/unit/<folder>/`` or ``tests/integration/<folder>/`` holds ``test_<module>.py`` or
    ``test_<module>_<aspect>.py``."""
    every = modules()
    without = [str(m.relative_to(PACKAGE)) for m in every if not has_a_test_named_after_it(m)]
    share = 1 - len(without) / len(every)
    assert share >= NAMED_AT_LEAST, (
        f"{len(every) - len(without)} of {len(every)} modules ({share:.0%}) have a test file "
        f"named after them, fewer than {NAMED_AT_LEAST:.0%}; without one: {', '.join(without)}")
