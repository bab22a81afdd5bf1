"""Hosts on one machine for the multi-host tests: a bridge on this host joins two network
namespaces, each with a veth pair and, for what runs in it, its own hostname. Needs root and
iproute2 (``ip``); the ``net`` fixture skips without them and removes everything it made.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]


def _why_not() -> Optional[str]:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (apt-get install iproute2 util-linux)"
    return None


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=30).stdout


def wait_until(predicate: Callable[[], bool], timeout: float, what: str,
               proc: Optional[subprocess.Popen] = None) -> None:
    """Wait for ``predicate``; fail early if ``proc`` (the one expected to make it true) exits."""
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        tick.wait(0.1)


@dataclass
class Host:
    ns: str
    hostname: str
    ip: str
    ifname: str


@dataclass
class Net:
    gateway: str  # this host's address on the bridge
    hosts: list[Host]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def spawn(self, argv: list[str], host: Optional[Host] = None,
              log: Optional[Path] = None) -> subprocess.Popen:
        """Start ``argv`` on this host, or inside ``host`` under its own hostname."""
        if host is not None:
            # `ip netns exec` enters the network namespace; `unshare --uts` gives the process
            # its own hostname, so the rank planner sees a separate host.
            inner = f"hostname {host.hostname} && exec " + " ".join(map(_quote, argv))
            argv = ["ip", "netns", "exec", host.ns, "unshare", "--uts", "sh", "-c", inner]
        out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115
        env = dict(os.environ, PYTHONPATH=str(REPO))
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            _kill_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.procs.clear()


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # started with start_new_session: the group is ours alone
    except ProcessLookupError:
        pass


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 under 10.77/16 that no interface here uses (parallel runs pick different ones)."""
    used = [ipaddress.ip_interface(w).network
            for line in sh("ip", "-4", "-o", "addr").splitlines()
            for w in line.split() if "/" in w and w[0].isdigit()]
    start = os.getpid() % 200
    for i in range(200):
        net = ipaddress.ip_network(f"10.77.{(start + i) % 200 + 20}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.77.x.0/24 subnet")


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    tag = str(os.getpid())
    subnet = _free_subnet()
    addrs = list(subnet.hosts())
    bridge = f"nbdbr{tag}"
    made_links: list[str] = []
    made_ns: list[str] = []
    the_net = Net(gateway=str(addrs[0]), hosts=[])
    try:
        sh("ip", "link", "add", bridge, "type", "bridge")
        made_links.append(bridge)
        sh("ip", "addr", "add", f"{addrs[0]}/{subnet.prefixlen}", "dev", bridge)
        sh("ip", "link", "set", bridge, "up")
        for i in (1, 2):
            ns, outer, inner = f"nbd-{tag}-{i}", f"nbdh{tag}{i}", f"nbdv{tag}{i}"
            sh("ip", "netns", "add", ns)
            made_ns.append(ns)
            sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            made_links.append(outer)
            sh("ip", "link", "set", inner, "netns", ns)
            sh("ip", "link", "set", outer, "master", bridge)
            sh("ip", "link", "set", outer, "up")
            ip = str(addrs[i])
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/{subnet.prefixlen}",
               "dev", inner)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            the_net.hosts.append(Host(ns, f"nbd-node{i}-{tag}", ip, inner))
        yield the_net
    finally:
        the_net.stop_all()
        for ns in made_ns:
            # Anything still inside our namespace was started by this module.
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                      text=True).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in made_links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
