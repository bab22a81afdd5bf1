"""This host's own address on the route to another (:mod:`nbdist.runtime.boot.route`): what a
worker started elsewhere binds, asked of the kernel's routing table (nothing is sent)."""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys

import pytest

from nbdist.runtime.boot.route import local_address


def test_the_route_to_loopback_starts_at_loopback():
    assert local_address("127.0.0.1") == "127.0.0.1"
    assert ipaddress.ip_address(local_address("127.0.0.2")).is_loopback


def test_an_ipv6_address_is_routed_as_ipv6():
    if not socket.has_ipv6:
        pytest.skip("this Python has no IPv6")
    try:
        assert local_address("::1") == "::1"
    except OSError as e:  # a host with IPv6 switched off
        pytest.skip(f"no IPv6 route to ::1 here: {e}")


def test_a_batch_jobs_script_asks_it_on_the_command_line():
    out = subprocess.run([sys.executable, "-m", "nbdist.runtime.boot.route", "127.0.0.1"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out == "127.0.0.1\n"
