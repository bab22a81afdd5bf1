"""``nbdist.ParameterServer``: asynchronous training against a parameter server.

Every rank makes one in a ``%%distributed`` cell. One rank (``server_rank``, default 0) also
runs the server: a thread that holds the master copy of the model and its optimizer. Workers
talk to it through the job's own key-value store (the ``TCPStore`` the process group met on,
served from rank 0 on ``MASTER_ADDR``), under a key prefix of their own:

* ``push(model)`` appends the model's gradients, with the version of the parameters they were
  computed from, to a queue in the store and returns: it waits for no other worker and not for
  the server to apply them.
* The server thread pops gradients in arrival order, drops those more than ``max_staleness``
  updates old, applies the rest with the optimizer, and stores the new parameters under one
  key with their version.
* ``pull(model)`` reads that key: the latest parameters, whatever any other worker is doing.

A slow worker therefore never slows a fast one; its gradients only arrive staler. Staleness is
the number of updates applied between a worker's pull and the update its gradient makes.
"""

from __future__ import annotations

import copy
import itertools
import json
import struct
import threading
import time
import warnings
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from . import memory
from .measure import _batch_size, telemetry

_HEADER = struct.Struct("<qq")  # pushes: rank, version the gradients were computed at
_VERSION = struct.Struct("<q")  # parameters: their version
_STOP = -1  # the "rank" of the message that stops the server thread
_instances = itertools.count()  # every rank makes its servers in the same order


def _pack(tensors: list[Optional[torch.Tensor]], like: list[torch.Tensor]) -> bytes:
    """The tensors' bytes, one after the other (zeros for a missing gradient)."""
    parts = []
    for t, ref in zip(tensors, like):
        t = torch.zeros_like(ref) if t is None else t.detach()
        parts.append(t.reshape(-1).cpu().view(torch.uint8))
    return torch.cat(parts).numpy().tobytes() if parts else b""


def _unpack(data: bytes, offset: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors shaped like ``like`` from ``data[offset:]`` (on the CPU)."""
    with warnings.catch_warnings():  # a bytearray is writable; torch warns for bytes only
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(bytearray(data[offset:]), dtype=torch.uint8)
    out, at = [], 0
    for ref in like:
        n = ref.numel() * ref.element_size()
        out.append(flat[at:at + n].view(ref.dtype).view(ref.shape))
        at += n
    return out


def _rebuild(optimizer: torch.optim.Optimizer, old: list[torch.nn.Parameter],
             new: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``optimizer``'s class, hyperparameters and state, over ``new`` (the copies of ``old``)."""
    index = {id(p): i for i, p in enumerate(old)}
    try:
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [new[index[id(p)]] for p in g["params"]]}
                  for g in optimizer.param_groups]
        opt = type(optimizer)(groups, **optimizer.defaults)
        opt.load_state_dict(optimizer.state_dict())
    except (KeyError, TypeError, ValueError) as exc:
        raise TypeError(f"ParameterServer could not make a copy of {type(optimizer).__name__} "
                        "for the server: give it a torch.optim optimizer over the model's own "
                        f"parameters ({exc})") from exc
    return opt


class ParameterServer:
    """Asynchronous training: workers pull the latest parameters and push gradients; a server
    thread on ``server_rank`` applies them with ``optimizer`` as they arrive.

    Make one on every rank in a ``%%distributed`` cell (not a collective: no rank waits for
    another, except that workers wait for the server's first parameters).

    Parameters
    ----------
    model : torch.nn.Module
        The model every worker trains; the server starts from ``server_rank``'s parameters.
    optimizer : torch.optim.Optimizer
        An optimizer over ``model``'s parameters. The server uses a copy with the same class,
        hyperparameters and state; workers never step one.
    max_staleness : int, optional
        Drop gradients computed from parameters more than this many updates old (counted in
        ``stats()["dropped"]``). Without it every gradient is applied, however stale.
    server_rank : int
        The rank whose process runs the server thread.

    Examples
    --------
    >>> ps = nbdist.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    >>> for x, y in loader:                      # doctest: +SKIP
    ...     ps.pull(model)                       # the latest parameters
    ...     loss_fn(model(x), y).backward()
    ...     ps.push(model)                       # gradients go; no waiting for anyone
    ...     model.zero_grad()
    >>> ps.wait(); ps.stats()                    # doctest: +SKIP
    {'updates': 412, 'dropped': 0, 'max_staleness': 6, 'mean_staleness': 1.9, ...}
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 max_staleness: Optional[int] = None, server_rank: int = 0,
                 timeout: float = 300.0) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ParameterServer needs the process group: make it in a "
                               "%%distributed cell, on every rank")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, not {max_staleness}")
        self.rank = dist.get_rank()
        self.server_rank = server_rank
        self.max_staleness = max_staleness
        self.pushes = 0  # pushes made by this rank
        self._params = list(model.parameters())
        self._version = 0  # of the parameters this rank last pulled
        self._timeout = timedelta(seconds=timeout)
        base = _get_default_store()
        prefix = f"nbdist/ps/{next(_instances)}/"
        self._store = dist.PrefixStore(prefix, base.clone())
        self._store.set_timeout(self._timeout)
        self._thread: Optional[threading.Thread] = None
        self._hook = model.register_forward_pre_hook(_count_samples)
        memory.modules.add(model)
        if self.rank == server_rank:
            self._start_server(model, optimizer, dist.PrefixStore(prefix, base.clone()))
        else:
            self._store.wait(["params"])

    # ----------------------------------------------------------------- the server
    def _start_server(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      store: Any) -> None:
        master = copy.deepcopy(model)
        self._master = list(master.parameters())
        self._opt = _rebuild(optimizer, self._params, self._master)
        memory.optimizers.add(self._opt)  # the server's parameters and state live here
        self._counts = {"updates": 0, "dropped": 0, "staleness_sum": 0, "max_staleness": 0}
        self._per_rank: dict[int, int] = {}
        self._publish(store)
        self._thread = threading.Thread(target=self._serve, args=(store,), daemon=True,
                                        name="nbdist-parameter-server")
        self._thread.start()

    def _publish(self, store: Any) -> None:
        version = self._counts["updates"]
        store.set("params", _VERSION.pack(version) + _pack(self._master, self._master))
        c = self._counts
        store.set("stats", json.dumps({
            "updates": c["updates"], "dropped": c["dropped"],
            "max_staleness": c["max_staleness"],
            "mean_staleness": c["staleness_sum"] / c["updates"] if c["updates"] else 0.0,
            "pushes": {str(r): n for r, n in sorted(self._per_rank.items())},
            "processed": c["updates"] + c["dropped"]}))

    def _serve(self, store: Any) -> None:
        telemetry.local.server = True  # its optimizer steps are not this rank's steps
        store.set_timeout(timedelta(days=365))  # idle between cells is not an error
        while True:
            try:
                msg = store.queue_pop("grads", True)
            except dist.DistStoreError:
                return  # the store is gone: the job ended or the group was re-formed
            rank, version = _HEADER.unpack_from(msg)
            if rank == _STOP:
                return
            self._apply(rank, version, msg)
            self._publish(store)

    def _apply(self, rank: int, version: int, msg: bytes) -> None:
        c = self._counts
        self._per_rank[rank] = self._per_rank.get(rank, 0) + 1
        staleness = c["updates"] - version
        if self.max_staleness is not None and staleness > self.max_staleness:
            c["dropped"] += 1
            return
        for p, g in zip(self._master, _unpack(msg, _HEADER.size, self._master)):
            p.grad = g.to(p.device)
        self._opt.step()
        c["updates"] += 1
        c["staleness_sum"] += staleness
        c["max_staleness"] = max(c["max_staleness"], staleness)

    # ----------------------------------------------------------------- workers
    def pull(self, model: torch.nn.Module) -> int:
        """Copy the latest parameters into ``model``; return their version (updates so far)."""
        t0 = time.time()
        data = self._store.get("params")
        (version,) = _VERSION.unpack_from(data)
        with torch.no_grad():
            for p, v in zip(model.parameters(), _unpack(data, _VERSION.size, self._params)):
                p.copy_(v)
        self._version = version
        telemetry.on_collective("ps_pull", t0, time.time(), len(data), _dtype(self._params),
                                blocking=True)
        return version

    def push(self, model: torch.nn.Module) -> None:
        """Send ``model``'s gradients to the server and return at once: the server applies
        them when it gets to them, to the parameters as they are by then. Ends a step."""
        t0 = time.time()
        grads = [p.grad for p in model.parameters()]
        msg = _HEADER.pack(self.rank, self._version) + _pack(grads, self._params)
        self._store.queue_push("grads", msg)
        self._store.add("issued", 1)
        self.pushes += 1
        telemetry.on_collective("ps_push", t0, time.time(), len(msg), _dtype(self._params),
                                blocking=True)
        if telemetry.enabled:
            telemetry.end_step("ps")

    def stats(self) -> dict[str, Any]:
        """The server's counters now: ``updates`` applied, ``dropped`` (too stale),
        ``max_staleness`` and ``mean_staleness`` of the applied ones, ``pushes`` received per
        rank, and ``processed`` (updates + dropped)."""
        out = json.loads(self._store.get("stats"))
        out["pushes"] = {int(r): n for r, n in out["pushes"].items()}
        return out

    def wait(self, timeout: float = 300.0) -> dict[str, Any]:
        """Block until the server has processed every push made so far (by any rank); return
        :meth:`stats`. Call it on every rank after training, before comparing counts."""
        issued = self._store.add("issued", 0)
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats["processed"] >= issued:
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"the parameter server on rank {self.server_rank} processed "
                                   f"{stats['processed']} of {issued} pushes in {timeout:g} s")
            time.sleep(0.005)  # on a worker, never the notebook

    def close(self) -> None:
        """Stop the server thread (on the server rank) and stop counting samples."""
        self._hook.remove()
        if self._thread is not None and self._thread.is_alive():
            self._store.queue_push("grads", _HEADER.pack(_STOP, 0))
            self._thread.join(timeout=10)

    def __repr__(self) -> str:
        try:
            s = self.stats()
        except Exception:  # the store may be gone with the job
            return f"<nbdist.ParameterServer on rank {self.server_rank}: unreachable>"
        bound = "" if self.max_staleness is None else f" (bound {self.max_staleness})"
        return (f"<nbdist.ParameterServer on rank {self.server_rank}: {s['updates']} updates, "
                f"{s['dropped']} dropped, staleness max {s['max_staleness']} mean "
                f"{s['mean_staleness']:.2f}{bound}>")


def _dtype(params: list[torch.Tensor]) -> str:
    return str(params[0].dtype)[6:] if params else ""


def _count_samples(_module: torch.nn.Module, args: tuple) -> None:
    if telemetry.enabled and torch.is_grad_enabled():
        telemetry.count_samples(_batch_size(args))
