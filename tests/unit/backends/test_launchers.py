"""The rules every launcher keeps: the profile's options add to nbdist's, and listeners stay on
loopback unless ``listen`` says otherwise. Each engine's recipes are tested in its folder."""

from __future__ import annotations

import pytest

from nbdist.backends.launchers import bind_host, is_loopback, merged


def test_merged_is_deep_and_leaves_its_arguments_alone():
    base = {"a": {"x": 1, "l": [1]}, "b": [1, 2], "c": 1}
    over = {"a": {"y": 2, "l": [2]}, "b": [2, 3], "c": 2, "d": 4}
    assert merged(base, over) == {"a": {"x": 1, "y": 2, "l": [1, 2]}, "b": [1, 2, 3], "c": 2,
                                  "d": 4}
    assert base == {"a": {"x": 1, "l": [1]}, "b": [1, 2], "c": 1}


def test_a_whole_command_replaces_nbdists_never_extends_it():
    base = {"engine_cmd": ["python", "-m", "ipyparallel.engine"], "args": ["-a"]}
    over = {"engine_cmd": ["/x/python", "-m", "ipyparallel.engine"], "args": ["-b"]}
    assert merged(base, over) == {"engine_cmd": ["/x/python", "-m", "ipyparallel.engine"],
                                  "args": ["-a", "-b"]}


@pytest.mark.parametrize("listen, host, loopback", [
    (None, "127.0.0.1", True), ("", "127.0.0.1", True), ("localhost", "localhost", True),
    ("127.0.0.2", "127.0.0.2", True), ("::1", "::1", True), ("*", "", False),
    ("10.1.2.3", "10.1.2.3", False), ("node1", "node1", False)])
def test_listeners_bind_loopback_unless_listen_says_otherwise(listen, host, loopback):
    assert bind_host(listen) == host
    assert is_loopback(listen) is loopback
