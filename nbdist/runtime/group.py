"""Rendezvous store and the default process group, formed once and kept across cells.

The store server runs inside rank 0's worker on a socket that nbdist binds itself, to exactly
``MASTER_ADDR`` (torch's own TCPStore would listen on every interface). Each formation of the
group uses a fresh key prefix, so a group can be re-formed after a failure or a scale.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

_servers: dict[str, tuple[Any, socket.socket]] = {}
_client: Optional[Any] = None
_client_addr: Optional[tuple[str, int]] = None
_generation: Optional[int] = None
_device_type = "cpu"  # of the tensors the ranks compute on: "cuda" or "cpu"
_group_fds: set[int] = set()  # sockets the group opened to its peers (gloo)
# How many times this process formed each generation. A generation formed again (the user's
# destroy_process_group() or a library's end_training() in a cell, then the next cell) must
# not read the previous formation's keys: torch names the default group the same each time,
# and a peer that read the other rank's old gloo address would connect to a closed port
# until the group's timeout. Every rank re-forms together, so their counts agree.
_formed: dict[int, int] = {}
_original_init = dist.init_process_group
_original_destroy = dist.destroy_process_group
#: process groups a cell destroyed, kept alive until the next cell begins (see
#: :func:`guarded_destroy_process_group`)
_destroyed: list[Any] = []


def open_store(host: str, purpose: str, timeout: float) -> int:
    """Start a store server bound to ``host`` on a free port; return the port."""
    close_store(purpose)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(512)
    port = sock.getsockname()[1]
    server = dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=timeout),
                           wait_for_workers=False, master_listen_fd=sock.fileno())
    _servers[purpose] = (server, sock)
    return port


def close_store(purpose: str) -> None:
    entry = _servers.pop(purpose, None)
    if entry is not None:
        server, sock = entry
        del server
        sock.close()


def client(addr: str, port: int, timeout: float) -> Any:
    """A client of the cluster's store (reused while the address stays the same)."""
    global _client, _client_addr
    if _client is None or _client_addr != (addr, port):
        _client = dist.TCPStore(addr, port, None, False, datetime.timedelta(seconds=timeout))
        _client_addr = (addr, port)
    return _client


def device_type() -> str:
    """``"cuda"`` when the ranks compute on GPUs (NCCL, or gloo on shared GPUs), else
    ``"cpu"``: the device type of the job's meshes."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return "cuda"
    return _device_type if dist.is_initialized() else "cpu"


def generation() -> Optional[int]:
    """The generation of the live group, or None when there is none."""
    return _generation if dist.is_initialized() else None


def form(gen: int, rank: int, world_size: int, backend: str, addr: str, port: int,
         timeout: float, device: Optional[torch.device]) -> None:
    """(Re)form the default process group as generation ``gen``; all ranks must call it."""
    global _generation, _group_fds, _device_type
    teardown()
    _device_type = device.type if device is not None else "cpu"
    again = _formed.get(gen, 0)
    _formed[gen] = again + 1
    prefix = f"nbdist/pg/{gen}" if again == 0 else f"nbdist/pg/{gen}.{again}"
    store = dist.PrefixStore(prefix, client(addr, port, timeout))
    kwargs: dict[str, Any] = {}
    if device is not None and device.type == "cuda" and backend == "nccl":
        # NCCL binds its communicator to the rank's GPU at once; gloo (ranks sharing a GPU)
        # takes CUDA tensors as they come, and binding it would move barriers to the GPU.
        kwargs["device_id"] = device
    before = _socket_fds()
    _original_init(backend, store=store, rank=rank, world_size=world_size,
                   timeout=datetime.timedelta(seconds=timeout), **kwargs)
    _group_fds = _not_store(_socket_fds() - before, port)
    _generation = gen


def _socket_fds() -> set[int]:
    """This process's socket file descriptors (Linux; empty elsewhere)."""
    fds = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return fds
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.add(int(name))
        except OSError:
            continue
    return fds


def _not_store(fds: set[int], store_port: int) -> set[int]:
    """Drop store connections from ``fds``: a peer's store client that connected while this
    rank formed the group is accepted by the store server here, and severing it would leave
    that peer unable to re-form the group."""
    hosted = {sock.getsockname()[1] for _, sock in _servers.values()}
    keep = set()
    for fd in fds:
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                local_port = s.getsockname()[1]
                try:
                    peer_port = s.getpeername()[1]
                except OSError:  # a listener
                    peer_port = None
        except (OSError, IndexError, TypeError):
            keep.add(fd)
            continue
        if local_port in hosted or peer_port == store_port:
            continue
        keep.add(fd)
    return keep


def sever() -> None:
    """Cut this rank's connections to its peers, from any thread; the group is unusable after.

    A collective blocked on them fails at once (see :mod:`.interrupt`).
    """
    _sever_peers()


def _sever_peers() -> None:
    """Close this rank's connections to its peers so their pending collectives fail at once.

    Destroying a gloo group does not close its sockets while DDP internals still reference
    it, and aborting is NCCL-only; shutting the connected sockets down makes every peer see
    "connection closed by peer" instead of waiting for the collective timeout.
    """
    if dist.is_initialized() and dist.get_backend() == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
        return
    for fd in _group_fds:
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    s.shutdown(socket.SHUT_RDWR)  # never the listener: gloo aborts on that
        except OSError:
            continue


def teardown(sever: bool = False) -> None:
    """Destroy the default group; with ``sever``, peers blocked on it fail fast."""
    global _generation, _group_fds
    if sever:
        _sever_peers()
    _group_fds = set()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group broken by a peer's crash cannot always be destroyed cleanly
            pass
    _generation = None


def mark_done(key: str) -> None:
    if _client is not None:
        _client.set(key, "1")


def wait_for_peers(keys: list[str], grace: float) -> bool:
    """True if every key appears within ``grace`` seconds."""
    if _client is None:
        return False
    deadline = time.monotonic() + grace
    while True:
        if all(_client.check([k]) for k in keys):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)  # worker-side wait for peers' end-of-cell marks; never the notebook


def guarded_init_process_group(*args: Any, **kwargs: Any) -> None:
    """``init_process_group`` that is a no-op when nbdist already formed the group.

    Code written for torchrun calls ``init_process_group()`` itself; in a ``%%distributed``
    cell the group already exists and the call must not fail.
    """
    if dist.is_initialized() and _generation is not None:
        return None
    return _original_init(*args, **kwargs)


def guarded_destroy_process_group(group: Any = None) -> None:
    """``destroy_process_group`` that keeps the groups it destroys alive until the next cell
    begins (:func:`release_destroyed`).

    torch's gloo group joins its worker threads in its destructor while holding the GIL, and a
    worker thread that is just letting go of a finished collective (a barrier holding an
    all-gather's tensors) needs the GIL to free them: when a library destroys the group right
    after a collective and the last reference goes at once (Accelerate's
    ``wait_for_everyone()`` then ``end_training()``, and the DDP model freed as the function
    returns), the rank waits for good. By the next cell its threads are idle.
    """
    try:
        world = dist.distributed_c10d._world
        _destroyed.extend(list(world.pg_map) if group is None else [group])
    except Exception:  # torch's registry moved: the groups go as torch frees them
        pass
    _original_destroy(group)


def release_destroyed() -> None:
    """Let go of the groups cells destroyed (as a cell begins: their threads are idle)."""
    _destroyed.clear()


def install_guard() -> None:
    dist.init_process_group = guarded_init_process_group
    dist.destroy_process_group = guarded_destroy_process_group


def resolved_backend(choice: str, device: torch.device) -> str:
    if choice != "auto":
        return choice
    return "nccl" if device.type == "cuda" else "gloo"
