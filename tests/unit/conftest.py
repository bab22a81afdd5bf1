"""Fixtures of the unit layer: the IPython shell with nbdist loaded, over a session on the
scripted backend that the magics reach as the default session (a module may define its own)."""

from __future__ import annotations

import pytest
from fakes import ScriptedBackend
from IPython.core.interactiveshell import InteractiveShell

from nbdist import session as session_mod
from nbdist.session import Session


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend(2)


@pytest.fixture
def session(backend, monkeypatch) -> Session:
    s = Session(backends=lambda engine: backend, stores=None).start(2, timeout=5)
    monkeypatch.setattr(session_mod, "_default", s)
    return s


@pytest.fixture
def shell(session):
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "nbdist")
    return sh
