"""Print pip constraints that pin every dependency of nbdist and its extras to its lower bound.

``NBDIST_DEPS=lowest bash scripts/test.sh`` installs with them, so that the suite runs against
the oldest releases ``pyproject.toml`` allows (torch excepted: the build in place is kept).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Optional

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
KEEP = {"torch"}  # never replaced: a CPU or CUDA build the user (or install-torch.sh) chose


def requirements(text: str) -> list[str]:
    """The quoted requirement strings of ``dependencies`` and every optional extra (a small
    reader, so that Python 3.9 and 3.10 need no TOML package)."""
    project = text.split("[project]", 1)[1].split("\n[tool.", 1)[0]  # not [build-system]
    out = []
    for block in re.findall(r"^(?:dependencies|[\w-]+) = \[(.*?)\]$", project, re.S | re.M):
        out += re.findall(r'"([^"]+)"', block)
    return out


def lower_bound(req: str) -> Optional[tuple[str, str, str]]:
    """``name[extra]>=1.2; marker`` -> ``("name", "1.2", "; marker")``; None without a bound."""
    m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*>=\s*([^,;\s]+)[^;]*(;.*)?", req)
    if m is None:
        return None
    return m.group(1).lower(), m.group(2), (m.group(3) or "").strip()


def main() -> None:
    bounds: dict[tuple[str, str], str] = {}  # (name, marker) -> the highest bound given
    for req in requirements(PYPROJECT.read_text(encoding="utf-8")):
        found = lower_bound(req)
        if found is None or found[0] in KEEP:
            continue
        name, version, marker = found
        old = bounds.get((name, marker))
        if old is None or _key(version) > _key(old):
            bounds[(name, marker)] = version
    sys.stdout.write("".join(f"{name}=={version}{' ' + marker if marker else ''}\n"
                             for (name, marker), version in bounds.items()))


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


if __name__ == "__main__":
    main()
