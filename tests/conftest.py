"""Shared fixtures: one real cluster per test module and engine; no process left behind.

Helpers tests import live in ``clusters.py``: pytest loads each conftest by its path, so no
test imports one by name.
"""

from __future__ import annotations

import os

import psutil
import pytest
from clusters import ENGINES, start_session


def _children() -> set[int]:
    """Child processes, less Python's multiprocessing resource tracker: it serves the whole
    interpreter (Dask's spawned workers start it) and exits with it."""
    return {p.pid for p in psutil.Process().children(recursive=True)
            if "multiprocessing.resource_tracker" not in " ".join(_cmdline(p))}


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@pytest.fixture(scope="session", autouse=True)
def no_leftover_processes():
    """Every process a test starts must be gone when the suite ends."""
    before = _children()
    yield
    left = []
    for pid in _children() - before:
        try:
            p = psutil.Process(pid)
            left.append(f"{pid} {' '.join(p.cmdline())[:120]}")
            p.kill()
        except psutil.NoSuchProcess:
            continue
    assert not left, "processes left behind:\n" + "\n".join(left)


@pytest.fixture(scope="module", params=ENGINES)
def cluster(request):
    """A 2-worker cluster shared by the tests of one module, for each engine."""
    s = start_session(request.param)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def tmp_cwd(tmp_path):
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(old)
