"""Starting real clusters for tests: the engines, and a session on one of them."""

from __future__ import annotations

import importlib.util

import pytest

from nbdist.session import Session

ENGINES = ["ipyparallel", "dask"]


def engine_available(engine: str) -> bool:
    if engine == "dask":
        return (importlib.util.find_spec("distributed") is not None
                and importlib.util.find_spec("nbdist.backends.dask") is not None)
    return True


def start_session(engine: str, n: int = 2, **kw) -> Session:
    if not engine_available(engine):
        pytest.skip(f"the {engine} engine is not available here")
    kw.setdefault("timeout", 60)
    return Session().start(n, engine=engine, **kw)
