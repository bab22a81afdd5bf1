"""The engine's nanny, started while the engine starts: its process and its fallbacks."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from nbdist.runtime import nanny

pytestmark = pytest.mark.timeout(60)


def test_a_nanny_whose_engine_never_registers_exits_quietly_at_end_of_input():
    proc = subprocess.run([sys.executable, "-m", "nbdist.runtime.nanny"], input=b"",
                          capture_output=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == b"" and proc.stdout == b""


def test_without_a_spawned_nanny_the_engine_starts_one_the_usual_way(monkeypatch):
    calls = []
    app = types.SimpleNamespace(start_nanny=lambda **kw: calls.append(kw) or ("tcp://x", None))
    monkeypatch.setattr(nanny, "_ready", None)
    nanny.install(app)
    assert app.start_nanny(engine_id=3) == ("tcp://x", None)
    assert calls == [{"engine_id": 3}]


def test_the_spawned_nanny_is_used_once_and_a_dead_one_falls_back(monkeypatch):
    calls = []
    app = types.SimpleNamespace(start_nanny=lambda **kw: calls.append(kw) or ("tcp://usual", None))
    dead = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    dead.wait(30)
    monkeypatch.setattr(nanny, "_ready", dead)
    nanny.install(app)
    assert app.start_nanny(engine_id=1)[0] == "tcp://usual"  # it had exited: not waited on
    assert nanny._ready is None  # and it is not offered again
    dead.stdin.close()
    dead.stdout.close()


def test_the_spawned_nanny_gets_the_engines_settings_and_answers_its_url(monkeypatch, tmp_path):
    # A stand-in for the nanny's process: echoes what it was sent, as the url line.
    echo = tmp_path / "echo.py"
    echo.write_text("import pickle, sys\n"
                    "kw = pickle.loads(sys.stdin.buffer.read())\n"
                    "print(f\"tcp://127.0.0.1:{kw['engine_id']}-{kw['pid']}\", flush=True)\n")
    proc = subprocess.Popen([sys.executable, str(echo)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    monkeypatch.setattr(nanny, "_ready", proc)
    app = types.SimpleNamespace(start_nanny=lambda **kw: pytest.fail("started a second nanny"))
    nanny.install(app)
    import os

    url, handle = app.start_nanny(engine_id=7)
    assert url == f"tcp://127.0.0.1:7-{os.getpid()}" and handle is proc
    proc.wait(30)
    proc.stdout.close()
