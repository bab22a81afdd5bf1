"""Several hosts on one machine: each worker in its own network and UTS namespace.

A bridge on this host joins two namespaces, each with a veth pair and its own hostname, so the
workers really are two hosts to nbdist: ranks are planned by host, MASTER_ADDR must be rank 0's
address on the shared network (not loopback), and gloo must talk across the bridge. Traffic
stays on loopback and the private subnet ``nethosts.py`` makes; a breakpoint on the other host
is answered from here through the notebook's store. Needs root and iproute2 (``ip``).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest
from nethosts import Net, wait_until

from nbdist.debugger import console as debugging
from nbdist.session import Session

ENGINES = ["ipyparallel", "dask"]

pytestmark = pytest.mark.timeout(240)


def _start_dask(net: Net, tmp: Path) -> tuple[dict, Callable[[], None]]:
    """A scheduler on this host's bridge address and one worker in each namespace."""
    import distributed

    sched_file = tmp / "scheduler.json"
    sched = net.spawn([sys.executable, "-m", "distributed.cli.dask_scheduler",
                       "--host", net.gateway, "--port", "0",
                       "--dashboard-address", f"{net.gateway}:0",
                       "--scheduler-file", str(sched_file)], log=tmp / "scheduler.log")
    wait_until(lambda: sched_file.exists() and sched_file.stat().st_size > 0, 60,
               "the Dask scheduler file", sched)
    address = json.loads(sched_file.read_text())["address"]
    for h in net.hosts:
        net.spawn([sys.executable, "-m", "distributed.cli.dask_worker", address,
                   "--host", h.ip, "--nthreads", "1", "--no-nanny", "--name", h.hostname,
                   "--dashboard-address", f"{h.ip}:0"], host=h,
                  log=tmp / f"worker-{h.hostname}.log")
    with distributed.Client(address, timeout=60) as c:
        c.wait_for_workers(2, timeout=90)
    return {"engine": "dask", "scheduler_file": str(sched_file)}, lambda: None


def _start_ipyparallel(net: Net, tmp: Path) -> tuple[dict, Callable[[], None]]:
    """An ipyparallel controller on this host's bridge address and an engine per namespace."""
    import ipyparallel as ipp

    profile = tmp / "profile"
    security = profile / "security"
    ctl = net.spawn([sys.executable, "-m", "ipyparallel.controller", f"--ip={net.gateway}",
               f"--profile-dir={profile}", "--log-level=WARN"], log=tmp / "controller.log")
    client_file, engine_file = security / "ipcontroller-client.json", \
        security / "ipcontroller-engine.json"
    wait_until(lambda: client_file.exists() and engine_file.exists(), 60,
               "the controller's connection files", ctl)
    for h in net.hosts:
        net.spawn([sys.executable, "-m", "ipyparallel.engine", f"--file={engine_file}",
                   f"--profile-dir={profile}", "--log-level=WARN"], host=h,
                  log=tmp / f"engine-{h.hostname}.log")
    c = ipp.Client(str(client_file), timeout=60)
    try:
        c.wait_for_engines(2, timeout=90)
    finally:
        c.close()
    return {"engine": "ipyparallel", "url_file": str(client_file)}, lambda: None


def _logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("*.log")))


@pytest.mark.parametrize("engine", ENGINES)
def test_two_hosts_run_one_ddp_job(net, engine, tmp_path, monkeypatch):
    if engine == "dask":
        pytest.importorskip("distributed")
    starter = _start_dask if engine == "dask" else _start_ipyparallel
    session = None
    try:
        target, _ = starter(net, tmp_path)
        session = Session().connect(timeout=90, **target)
        assert session.backend.controller_ip == net.gateway
        assert session.world_size == 2
        session.run_cell(textwrap.dedent("""
            import os, socket, torch, torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t)
            torch.manual_seed(0)
            net = torch.nn.Linear(3, 1)
            ddp = DDP(net)
            ddp(torch.full((2, 3), float(rank + 1))).sum().backward()
            info = {k: os.environ.get(k) for k in ("MASTER_ADDR", "LOCAL_RANK", "RANK",
                    "GROUP_RANK", "LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME")}
            info.update(host=socket.gethostname(), sum=t.item(),
                        grad=net.weight.grad.flatten().tolist())
        """), output="quiet", timeout=120)
        infos = [session.pull("info", rank=r) for r in range(2)]
        # pdb on rank 1, on the other host, answered here (as if typed into the input box)
        # through the notebook's store on the shared network, while rank 0 waits for it
        answers = iter(["p t", "t = t * 10", "c"])
        monkeypatch.setattr(debugging, "stdin_state", lambda: (True, ""))
        monkeypatch.setattr(debugging, "ask_user", lambda prompt: next(answers))
        session.run_cell("t = torch.tensor([float(rank + 1)])\nif rank == 1:\n"
                         "    breakpoint()\ndist.all_reduce(t)\ndebugged = t.item()",
                         output="quiet", timeout=120)
        assert next(answers, None) is None  # every line was asked for
        debugged = session.pull("debugged", rank=0)
    except BaseException:
        print(_logs(tmp_path))
        raise
    finally:
        if session is not None:
            session.stop()
        net.stop_all()
    by_name = {h.hostname: h for h in net.hosts}
    # Engines may register in either order; rank 0 is whichever host got it.
    assert sorted(i["host"] for i in infos) == sorted(by_name)
    for r, info in enumerate(infos):
        host = by_name[info["host"]]
        # The rendezvous store runs beside the notebook (so any rank may die): its address is
        # the notebook host's on the network the workers share, never loopback.
        assert info["MASTER_ADDR"] == net.gateway
        assert info["LOCAL_RANK"] == "0" and info["LOCAL_WORLD_SIZE"] == "1"
        assert info["RANK"] == info["GROUP_RANK"] == str(r)
        assert info["GLOO_SOCKET_IFNAME"] == host.ifname
        assert info["sum"] == 3.0
        # DDP averages d(sum(Wx+b))/dW = 2*x over ranks: (2*1 + 2*2) / 2 = 3 per weight.
        assert info["grad"] == [3.0, 3.0, 3.0]
    assert debugged == 1.0 + 20.0  # rank 1's assignment in pdb took part in the all_reduce
