"""The README's module map ("## Layout") stays the package's map: every module of ``nbdist/`` is
named in its folder's entry, every folder has an entry, and every file or folder the map names
exists.

The map is the fenced block whose first line starts with ``nbdist/``. A line that starts with
``nbdist/...`` at column 0 opens a folder's entry; the indented lines after it continue it. In an
entry, a bare ``name.py`` is a module of that folder; a path with a slash (``runtime/group.py``)
is read from that folder first, then from ``nbdist/``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nbdist"
FILE = re.compile(r"(?<![\w/.])((?:[A-Za-z_]\w*/)*[A-Za-z_]\w*\.py)\b")
# a folder ends with its slash: "runtime/boot/", never prose such as "push/pull"
FOLDER = re.compile(r"(?<![\w/.])((?:[A-Za-z_]\w*/)+)(?![\w.])")


def the_map(readme: str) -> list[str]:
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", readme, flags=re.S | re.M)
    maps = [b for b in blocks if b.startswith("nbdist/")]
    assert len(maps) == 1, "README.md has one fenced block that starts with 'nbdist/'"
    return maps[0].splitlines()


def entries(lines: list[str], root: Path = ROOT) -> dict[Path, str]:
    """Folder -> the text of its entry (the header line and its indented continuation)."""
    found: dict[Path, list[str]] = {}
    current: list[str] | None = None
    for line in lines:
        if line.startswith("nbdist/"):
            head = line.split()[0]
            assert head.endswith("/"), f"an entry opens with a folder: {line!r}"
            current = found.setdefault(root / head.rstrip("/"), [])
            current.append(line[len(head):])
        elif line.startswith(" ") and current is not None:
            current.append(line)
        else:
            current = None  # tests/, notebooks/, benchmarks/: the repository's other folders
    return {folder: "\n".join(text) for folder, text in found.items()}


def resolve(folder: Path, name: str, package: Path = PACKAGE) -> Path | None:
    for base in (folder, package):
        if (base / name).exists():
            return base / name
    return None


def package_folders() -> set[Path]:
    return {p.parent for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


def test_every_module_is_named_in_its_folders_entry():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    mapped = entries(the_map(readme))
    unmapped = sorted(str(f.relative_to(ROOT)) + "/" for f in package_folders() - set(mapped))
    assert unmapped == [], f"folders with no entry in README.md's map: {unmapped}"
    named = {resolve(folder, name) for folder, text in mapped.items()
             for name in FILE.findall(text) if "/" not in name}
    missing = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                     if p.name != "__init__.py" and "__pycache__" not in p.parts
                     and p not in named)
    assert missing == [], f"modules README.md's map does not name in their folder: {missing}"


def test_every_path_the_map_names_exists():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    wrong = []
    for folder, text in entries(the_map(readme)).items():
        if not folder.is_dir():
            wrong.append(str(folder.relative_to(ROOT)) + "/")
        for name in FILE.findall(text):
            if resolve(folder, name) is None:
                wrong.append(f"{name} (in {folder.relative_to(ROOT)}/)")
        for name in FOLDER.findall(text):
            if resolve(folder, name) is None:
                wrong.append(f"{name} (in {folder.relative_to(ROOT)}/)")
    assert wrong == [], f"README.md's map names what does not exist: {wrong}"


def test_the_map_reads_its_own_format(tmp_path):
    """The reading itself, on a package of its own: a module named elsewhere than in its
    folder's entry is not counted there, a stale name does not resolve, prose is no folder."""
    package = tmp_path / "nbdist"
    for name in ("cell/loop.py", "cell/interrupt.py", "runtime/end_marks.py"):
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).touch()
    lines = ["nbdist/cell/        one cell: loop.py, gone.py ↔ runtime/end_marks.py",
             "                    (start/connect)",
             "nbdist/runtime/     interrupt.py",
             "tests/unit/         end.py"]
    mapped = entries(lines, tmp_path)
    assert list(mapped) == [package / "cell", package / "runtime"]
    cell = mapped[package / "cell"]
    assert FILE.findall(cell) == ["loop.py", "gone.py", "runtime/end_marks.py"]
    assert resolve(package / "cell", "gone.py", package) is None
    assert resolve(package / "cell", "runtime/end_marks.py", package) == (
        package / "runtime" / "end_marks.py")
    assert resolve(package / "runtime", "interrupt.py", package) is None  # it is cell's
    assert FOLDER.findall(cell) == []
    assert FOLDER.findall("the processes runtime/boot/ runs (push/pull)") == ["runtime/boot/"]
