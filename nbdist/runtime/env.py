"""The torchrun contract, in one pure module: which worker gets which rank, and its environment.

Input is what each worker says about itself (``describe()`` in :mod:`nbdist.runtime.worker`);
output is one :class:`RankPlan` per worker. Ranks are grouped by host so ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` mean what they mean under ``torchrun``; ``MASTER_ADDR`` is loopback only
when every worker shares one host, else an address of rank 0's host that the other hosts reach.
Beside it, :func:`count_local_gpus` probes this host for the default number of workers.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class RankPlan:
    """Where one worker sits in the job."""

    worker_id: Any
    hostname: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    threads: int
    gpu: Optional[int]
    ifname: Optional[str] = None
    extra: Mapping[str, str] = field(default_factory=dict)

    def env(self, master_port: int, run_id: str = "nbdist") -> dict[str, str]:
        """Environment variables exactly as ``torchrun`` sets them for this rank."""
        env = {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "GROUP_WORLD_SIZE": str(self.num_nodes),
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "ROLE_NAME": "default",
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": run_id,
            # The store is hosted by nbdist (as torchrun's agent hosts it), so a script's own
            # env:// init connects as a client instead of trying to bind MASTER_PORT again.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "OMP_NUM_THREADS": str(self.threads),
        }
        if self.ifname:
            env["GLOO_SOCKET_IFNAME"] = self.ifname
        env.update(self.extra)
        return env


def _networks(worker: Mapping[str, Any]) -> list[ipaddress.IPv4Network]:
    nets = []
    for a in worker.get("addresses", ()):
        try:
            nets.append(ipaddress.ip_interface(f"{a['ip']}/{a.get('prefix', 32)}").network)
        except ValueError:
            continue
    return nets


def _iface_for(worker: Mapping[str, Any], peer_ip: str) -> Optional[str]:
    """The interface of ``worker`` on the same network as ``peer_ip``."""
    ip = ipaddress.ip_address(peer_ip)
    for a in worker.get("addresses", ()):
        try:
            if ip in ipaddress.ip_interface(f"{a['ip']}/{a.get('prefix', 32)}").network:
                return a.get("iface")
        except ValueError:
            continue
    return None


def choose_master_addr(host0_workers: Sequence[Mapping[str, Any]],
                       other_hosts: Sequence[Sequence[Mapping[str, Any]]],
                       fallback: bool = True) -> str:
    """Pick an address of rank 0's host that every other host shares a network with.

    Falls back (with ``fallback``) to the address rank 0 uses to reach the controller.
    """
    w0 = host0_workers[0]
    candidates = []
    if w0.get("route_ip"):
        candidates.append(w0["route_ip"])
    candidates += [a["ip"] for a in w0.get("addresses", ()) if a["ip"] not in candidates]
    for ip in candidates:
        addr = ipaddress.ip_address(ip)
        if addr.is_loopback:
            continue
        if all(any(addr in net for net in _networks(h[0])) for h in other_hosts):
            return ip
    if fallback and w0.get("route_ip") and not ipaddress.ip_address(w0["route_ip"]).is_loopback:
        return w0["route_ip"]
    raise ValueError(
        f"no address of rank 0's host {w0.get('hostname')!r} is reachable from the other hosts; "
        "give the workers a common network"
    )


def store_addr(kernel: Mapping[str, Any], workers: Sequence[Mapping[str, Any]]) -> Optional[str]:
    """An address of the notebook's host (``kernel``, a ``describe()`` record) that every
    worker reaches, for a rendezvous store that outlives any rank; None when there is none.

    Loopback when every worker runs on the notebook's host; else an address of the notebook's
    host on a network each worker host shares.
    """
    hosts = {w["hostname"] for w in workers}
    if hosts == {kernel.get("hostname")}:
        return LOOPBACK
    by_host: dict[str, list[Mapping[str, Any]]] = {}
    for w in workers:
        by_host.setdefault(w["hostname"], []).append(w)
    try:
        return choose_master_addr([kernel], list(by_host.values()), fallback=False)
    except ValueError:
        return None


def plan_ranks(workers: Sequence[Mapping[str, Any]], *, threads: Optional[int] = None,
               use_gpus: bool = True, master: Optional[str] = None,
               pinned: Optional[Mapping[Any, int]] = None) -> list[RankPlan]:
    """Assign ranks to workers, grouped by host, in the order the workers are given.

    Parameters
    ----------
    workers : sequence of dict
        ``describe()`` records: ``worker_id``, ``hostname``, ``cpu_count``, ``gpu_count``,
        ``addresses`` (``ip``/``prefix``/``iface``) and ``route_ip``.
    threads : int, optional
        torch intra-op threads per worker; default: the host's cores divided among its workers.
    use_gpus : bool
        Pin each worker to a GPU where its host has GPUs: the next one no worker holds, else
        ``local_rank % gpu_count`` (more workers than GPUs share them).
    pinned : mapping, optional
        The GPU a worker already uses, by worker id: it keeps it (a process keeps its CUDA
        device when the group is formed again around it, e.g. after an elastic failure).
    master : str, optional
        ``MASTER_ADDR`` when the store is hosted elsewhere than rank 0's host (see
        :func:`store_addr`); default: an address of rank 0's host.
    """
    if not workers:
        raise ValueError("no workers to plan ranks for")
    hosts: dict[str, list[Mapping[str, Any]]] = {}
    for w in workers:
        hosts.setdefault(w["hostname"], []).append(w)
    host_list = list(hosts.values())
    world = len(workers)
    if master is None:
        master = (LOOPBACK if len(host_list) == 1
                  else choose_master_addr(host_list[0], host_list[1:]))
    plans = []
    rank = 0
    pinned = pinned or {}
    for node_rank, members in enumerate(host_list):
        local_n = len(members)
        held = {pinned[w["worker_id"]] for w in members if w["worker_id"] in pinned}
        free = [g for g in range(int(members[0].get("gpu_count") or 0)) if g not in held]
        for local_rank, w in enumerate(members):
            cores = int(w.get("cpu_count") or 1)
            n_threads = threads or max(1, cores // local_n)
            gpus = int(w.get("gpu_count") or 0)
            gpu = None
            if use_gpus and gpus:
                gpu = (pinned[w["worker_id"]] if w["worker_id"] in pinned
                       else free.pop(0) if free else local_rank % gpus)
            ifname = "lo" if master == LOOPBACK else _iface_for(w, master)
            plans.append(RankPlan(
                worker_id=w["worker_id"], hostname=w["hostname"], rank=rank,
                local_rank=local_rank, world_size=world, local_world_size=local_n,
                node_rank=node_rank, num_nodes=len(host_list), master_addr=master,
                threads=n_threads, gpu=gpu, ifname=ifname,
            ))
            rank += 1
    return plans


def count_local_gpus() -> int:
    """GPUs visible on this host, without initializing CUDA (the notebook's default ``-n``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
        return len(ids)
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def shared_gpus(plans: Sequence[RankPlan]) -> dict[tuple[str, int], list[int]]:
    """GPUs that more than one rank is pinned to, as ``{(host, gpu): [ranks]}``.

    NCCL needs one GPU per rank: see :func:`choose_dist_backend`.
    """
    users: dict[tuple[str, int], list[int]] = {}
    for p in plans:
        if p.gpu is not None:
            users.setdefault((p.hostname, p.gpu), []).append(p.rank)
    return {k: v for k, v in users.items() if len(v) > 1}


def choose_dist_backend(asked: str, plans: Sequence[RankPlan]) -> tuple[str, str]:
    """The process group's backend for ``plans`` (``auto``: each rank picks NCCL on a GPU,
    gloo on the CPU), and a line for the user ("" when there is nothing to say).

    NCCL needs one GPU per rank, so where ranks would share one, ``auto`` becomes gloo: the
    ranks still compute on their GPU, and gloo carries the CUDA tensors of ``all_reduce`` and
    ``broadcast`` (what DDP calls) through host memory. ``nccl`` on shared GPUs is refused
    (:class:`ValueError`, naming the GPU and its ranks).
    """
    shared = shared_gpus(plans) if asked != "gloo" else {}
    if not shared:
        return asked, ""
    (host, gpu), ranks = next(iter(shared.items()))
    where = f"ranks {', '.join(map(str, ranks))} share GPU {gpu} on {host}"
    if len(shared) > 1:
        more = len(shared) - 1
        where += f" (and {more} more GPU{'s are' if more > 1 else ' is'} shared)"
    if asked == "nccl":
        raise ValueError(where)
    return "gloo", (f"{where}, and NCCL needs one GPU per rank: the process group uses gloo, "
                    "which carries the ranks' CUDA tensors through host memory (one worker per "
                    "GPU gets NCCL: -n without a number)")


def apply_env(target: MutableMapping[str, str],
              values: Mapping[str, Optional[str]]) -> dict[str, Optional[str]]:
    """Set ``values`` in ``target`` (None: remove the variable); return what was there before,
    for :func:`restore_env`."""
    previous = {k: target.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = v
    return previous


def restore_env(target: MutableMapping[str, str], previous: Mapping[str, Optional[str]]) -> None:
    """Undo :func:`apply_env`."""
    for k, v in previous.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = v
