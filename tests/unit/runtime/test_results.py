"""The worker→notebook contract: how a rank's failure is classified, once, on the worker."""

from __future__ import annotations

import os

import pytest

from nbdist.errors import DistributedError, RankFailure
from nbdist.runtime import results

# A stand-in for torch's own source file: the classification looks at where an error was raised.
TORCH_FILE = os.path.join(os.sep, "site-packages", "torch", "distributed", "distributed_c10d.py")
CELL = "<distributed cell 7>"


def raised_in(filename: str, exc: BaseException) -> BaseException:
    """``exc`` as raised by code compiled from ``filename``, called from a cell's frame."""
    torch_ns: dict = {}
    exec(compile("def all_reduce(exc):\n    raise exc\n", TORCH_FILE, "exec"), torch_ns)
    cell_ns = {"all_reduce": torch_ns["all_reduce"], "exc": exc}
    code = "raise exc\n" if filename == CELL else "all_reduce(exc)\n"
    try:
        exec(compile(code, CELL, "exec"), cell_ns)
    except BaseException as e:  # the test wants whatever was raised
        return e
    raise AssertionError("nothing raised")


BROKEN_PIPE = "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Write error: Broken pipe"


def test_broken_pipe_from_a_collective_is_one_communication_failure():
    # Before the contract, the worker's regex missed "Broken pipe" (no teardown) while the
    # notebook's matched it (reported as communication). Now the worker decides once and the
    # notebook reads the same flag.
    exc = raised_in(TORCH_FILE, RuntimeError(BROKEN_PIPE))
    info = results.error_info(exc, CELL)
    assert info["communication"] and info["caused_by_peer"]
    assert info["line"] == 1 and info["ename"] == "RuntimeError"
    failure = RankFailure.from_result(0, "hostA", results.cell_failed(info))
    assert failure.communication and failure.caused_by_peer


@pytest.mark.parametrize("text", ["timed out", "Connection closed by peer", BROKEN_PIPE,
                                  "process group is gone"])
def test_the_users_own_exception_is_never_a_communication_failure(text):
    exc = raised_in(CELL, RuntimeError(text))
    info = results.error_info(exc, CELL)
    assert not info["communication"] and not info["caused_by_peer"]


@pytest.mark.parametrize("text,peer", [
    ("[gloo] Timed out waiting 8000ms for recv", False),
    ("Default process group has not been initialized, please make sure to call "
     "init_process_group.", False),
    ("[pair.cc:553] Connection closed by peer [127.0.0.1]:1", True),
])
def test_torch_communication_errors(text, peer):
    info = results.error_info(raised_in(TORCH_FILE, RuntimeError(text)), CELL)
    assert info["communication"] and info["caused_by_peer"] is peer


def test_a_code_error_raised_inside_torch_is_not_communication():
    exc = raised_in(TORCH_FILE, ValueError("Tensors must be contiguous"))
    assert not results.error_info(exc, CELL)["communication"]


def test_overrides_and_syntax_errors():
    exc = raised_in(CELL, KeyboardInterrupt())
    info = results.error_info(exc, CELL, communication=True, evalue="cut loose")
    assert info["communication"] and info["evalue"] == "cut loose"
    try:
        compile("x = (", CELL, "exec")
    except SyntaxError as e:
        syntax = results.error_info(e, CELL)
    assert syntax["ename"] == "SyntaxError" and "Traceback" not in syntax["traceback"]


def test_traceback_keeps_cell_frames_only():
    exc = raised_in(TORCH_FILE, RuntimeError("boom"))
    tb = results.error_info(exc, CELL)["traceback"]
    assert CELL in tb and TORCH_FILE in tb and __file__ not in tb


def test_result_constructors():
    done = results.finish(results.cell_ok({"text/plain": "1"}), seconds=0.5, group_alive=True,
                          seq=3)
    assert done == {"ok": True, "value": {"text/plain": "1"}, "error": None, "seconds": 0.5,
                    "group_alive": True, "seq": 3}
    script = results.script_result(2, False, 0)
    failure = RankFailure.from_result(1, "h", script)
    assert not script["ok"] and failure.ename == "ScriptError" and "status 2" in failure.evalue
    interrupted = RankFailure.from_result(1, "h", results.script_result(-9, True, 0))
    assert interrupted.evalue == "interrupted"
    engine = results.engine_failure("EngineError: Engine 3 died\nmore")
    assert engine["group_alive"] is False
    assert engine["error"]["evalue"] == "EngineError: Engine 3 died"
    assert results.pulled()["ok"] and not results.not_pulled("no")["ok"]


def test_error_from_results_names_cause_and_consequence():
    cause = RankFailure.from_result(1, "hostB", results.cell_failed(results.error_info(
        raised_in(CELL, ZeroDivisionError("division by zero")), CELL)))
    peer = RankFailure.from_result(0, "hostA", results.cell_failed(results.error_info(
        raised_in(TORCH_FILE, RuntimeError("Connection reset by peer")), CELL)))
    err = DistributedError([peer, cause])
    assert err.causes == [cause]
    assert str(err) == ("cell failed on rank 1: ZeroDivisionError: division by zero "
                        "(rank 0 stopped because of it)")
