"""Shared fixtures: one real cluster per test module and engine; no process left behind."""

from __future__ import annotations

import importlib.util
import os

import psutil
import pytest

from nbdist.session import Session

ENGINES = ["ipyparallel", "dask"]


def engine_available(engine: str) -> bool:
    if engine == "dask":
        return (importlib.util.find_spec("distributed") is not None
                and importlib.util.find_spec("nbdist.backends.dask") is not None)
    return True


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


def start_session(engine: str, n: int = 2, **kw) -> Session:
    if not engine_available(engine):
        pytest.skip(f"the {engine} engine is not available here")
    kw.setdefault("timeout", 60)
    return Session().start(n, engine=engine, **kw)


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
