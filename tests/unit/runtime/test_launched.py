"""A rank's process as libraries see it: the kernel's variables dropped, REPL and shell hidden
for a cell's time and put back after it."""

from __future__ import annotations

import builtins
import sys
import types

from nbdist.runtime import launched
from nbdist.runtime.env import apply_env, restore_env


def test_kernel_variables_go_back_to_the_start_environment_or_away():
    environ = {"TERM": "xterm-color", "FORCE_COLOR": "1", "CLICOLOR_FORCE": "1",
               "MPLBACKEND": "module://matplotlib_inline.backend_inline", "JPY_PARENT_PID": "7",
               "PAGER": "less", "FORCE_COLOR_X": "1", "HOME": "/home/u", "MPLBACKEND_X": "x"}
    started = {"TERM": "xterm-256color", "FORCE_COLOR": "1"}
    assert launched.launch_env(environ, started) == {
        "TERM": "xterm-256color", "FORCE_COLOR": None, "CLICOLOR_FORCE": None,
        "MPLBACKEND": None, "JPY_PARENT_PID": None}
    # a user's own choice (a colour setting, a backend that is not a notebook's) stays
    assert launched.launch_env({"FORCE_COLOR": "3", "MPLBACKEND": "Agg"}, {}) == {}


def test_apply_env_removes_and_restore_env_brings_back():
    env = {"FORCE_COLOR": "1", "TERM": "xterm-color"}
    before = apply_env(env, {"FORCE_COLOR": None, "RANK": "0"})
    assert env == {"TERM": "xterm-color", "RANK": "0"}
    restore_env(env, before)
    assert env == {"FORCE_COLOR": "1", "TERM": "xterm-color"}


def test_start_environment_is_this_process_s():
    started = launched.start_environment()
    if sys.platform.startswith("linux"):
        assert started.get("PATH") is not None


class _Singleton:
    _instance = None


class _Shell(_Singleton):
    _instance = None


def test_a_cell_sees_no_repl_no_shell_and_the_engine_gets_them_back(monkeypatch):
    shell = _Shell()
    _Singleton._instance = _Shell._instance = shell
    module = types.ModuleType("IPython.core.interactiveshell")
    module.InteractiveShell = _Singleton  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython.core.interactiveshell", module)
    monkeypatch.setattr(sys, "ps1", "In : ", raising=False)
    monkeypatch.setattr(builtins, "__IPYTHON__", True, raising=False)
    hook = lambda value: None  # noqa: E731
    monkeypatch.setattr(sys, "displayhook", hook)
    with launched.launched():
        assert not hasattr(sys, "ps1")
        assert not hasattr(builtins, "__IPYTHON__")
        assert sys.displayhook is sys.__displayhook__
        assert _Singleton._instance is None and _Shell._instance is None
        assert launched.shell() is shell  # nbdist's event channel still finds it
    assert sys.ps1 == "In : " and builtins.__IPYTHON__ is True and sys.displayhook is hook
    assert _Singleton._instance is shell and _Shell._instance is shell
    assert launched.shell() is shell
