"""``nbdist.ParameterServer``: asynchronous training against a parameter server.

Every rank makes one in a ``%%distributed`` cell. One rank (``server_rank``, default 0) also
runs the server in two threads beside its own training:

* a **receiver** waits for messages from any other rank on a gloo group of the parameter
  server's own (``torch.distributed.new_group``): a push (its gradients go to the applier's
  queue) or a pull (the latest parameters are sent back at once);
* an **applier** takes pushes from that queue in arrival order, drops those computed from
  parameters more than ``max_staleness`` updates old, and applies the rest with the optimizer.

The server rank's own worker reaches the server in memory (its pushes join the same queue).
A push returns once its gradients are handed to gloo (or the queue): it waits for no other
worker and not for the update. A pull waits only for the server to copy its parameters. So a
slow worker never slows a fast one; its gradients only arrive staler. Counters (updates,
staleness, pushes issued and processed) live in the job's key-value store, so every rank can
read them.

Staleness of an update is the number of updates applied between the pull its gradients were
computed after and the update itself.
"""

from __future__ import annotations

import copy
import itertools
import json
import queue
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from .measure import memory
from .measure.model import measurements
from .measure.tensors import batch_size

_PUSH, _PULL, _STOP = 0, 1, 2
# Point-to-point tags far from the slots gloo numbers collectives with.
_TAG_HEADER, _TAG_GRADS, _TAG_PARAMS = 7_000_001, 7_000_002, 7_000_003
_instances = itertools.count()  # every rank makes its servers in the same order
_open: weakref.WeakSet[ParameterServer] = weakref.WeakSet()


class _Layout:
    """Where each tensor's bytes sit in one flat byte buffer (8-byte aligned, so any dtype
    can be viewed in place)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.specs: list[tuple[int, int, torch.dtype, torch.Size]] = []
        at = 0
        for p in params:
            n = p.numel() * p.element_size()
            self.specs.append((at, n, p.dtype, p.shape))
            at += -(-n // 8) * 8
        self.nbytes = at

    def buffer(self) -> torch.Tensor:
        return torch.zeros(self.nbytes, dtype=torch.uint8)

    def pack(self, tensors: list[Optional[torch.Tensor]], out: torch.Tensor) -> torch.Tensor:
        """Copy ``tensors`` into ``out`` (zeros where one is None); return ``out``."""
        for (at, n, _dtype, _shape), t in zip(self.specs, tensors):
            if t is None:
                out[at:at + n].zero_()
            else:
                out[at:at + n].copy_(t.detach().reshape(-1).view(torch.uint8))
        return out

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """The tensors stored in ``buf``, as views."""
        return [buf[at:at + n].view(dtype).view(shape) for at, n, dtype, shape in self.specs]


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
    on ``server_rank`` applies them with ``optimizer`` as they arrive.

    Make one on every rank in a ``%%distributed`` cell (it forms a process group of its own,
    so every rank must make it, in the same order). Making a new one closes the previous one.

    Parameters
    ----------
    model : torch.nn.Module
        The model every worker trains; the server starts from ``server_rank``'s parameters.
    optimizer : torch.optim.Optimizer
        An optimizer over ``model``'s parameters. The server uses a copy with the same class,
        hyperparameters and state; workers never step one.
    max_staleness : int, optional
        Drop gradients computed from parameters more than this many updates old (counted in
        ``stats()["dropped"]``); a fast worker is never made to wait. Without it every
        gradient is applied, however stale.
    server_rank : int
        The rank whose process runs the server.

    Examples
    --------
    >>> ps = nbdist.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    >>> for x, y in loader:                      # doctest: +SKIP
    ...     ps.pull(model)                       # the latest parameters
    ...     loss_fn(model(x), y).backward()
    ...     ps.push(model)                       # gradients go; no waiting for anyone
    ...     model.zero_grad()
    >>> ps.wait()                                # doctest: +SKIP
    {'updates': 412, 'dropped': 0, 'max_staleness': 6, 'mean_staleness': 1.9, ...}
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 max_staleness: Optional[int] = None, server_rank: int = 0) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ParameterServer needs the process group: make it in a "
                               "%%distributed cell, on every rank")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, not {max_staleness}")
        world = dist.get_world_size()
        if not 0 <= server_rank < world:
            raise ValueError(f"server_rank {server_rank} is not a rank of this job (0-"
                             f"{world - 1})")
        for earlier in list(_open):  # every rank makes this one: close the last together
            earlier.close()
        self.rank = dist.get_rank()
        self.server_rank = server_rank
        self.max_staleness = max_staleness
        self.pushes = 0  # pushes made by this rank
        self._params = list(model.parameters())
        self._layout = _Layout(self._params)
        self._version = 0  # of the parameters this rank last pulled
        self._sending: list[Any] = []  # this rank's last push, until gloo has sent it
        self._closed = False
        prefix = f"nbdist/ps/{next(_instances)}/"
        self._store = dist.PrefixStore(prefix, _get_default_store().clone())
        # Its own channel, never idle-timed-out: between cells the server simply waits.
        self._group = dist.new_group(backend="gloo", timeout=timedelta(days=365))
        self._hook = model.register_forward_pre_hook(_count_samples)
        memory.modules.add(model)
        self._threads: list[threading.Thread] = []
        if self.rank == server_rank:
            self._start_server(model, optimizer, prefix)
        else:
            self._send_buf = self._layout.buffer()
            self._recv_buf = self._layout.buffer()
        self._store.wait(["stats"])  # the server is up
        _open.add(self)

    # ----------------------------------------------------------------- the server
    def _start_server(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      prefix: str) -> None:
        self._master = list(copy.deepcopy(model).parameters())
        self._opt = _rebuild(optimizer, self._params, self._master)
        memory.optimizers.add(self._opt)  # the server's parameters and state live here
        self._lock = threading.Lock()  # the applier's step vs. copies of the parameters
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._updates = self._dropped = self._staleness_sum = self._max_seen = 0
        self._per_rank: dict[int, int] = {}
        self._server_store = dist.PrefixStore(prefix, _get_default_store().clone())
        self._publish()
        threads = [("applier", self._apply_loop)]
        if self._group.size() > 1:
            threads.append(("receiver", self._receive_loop))
        for name, target in threads:
            t = threading.Thread(target=target, daemon=True, name=f"nbdist-ps-{name}")
            t.start()
            self._threads.append(t)

    def _publish(self) -> None:
        processed = self._updates + self._dropped
        self._server_store.set("stats", json.dumps({
            "updates": self._updates, "dropped": self._dropped,
            "max_staleness": self._max_seen,
            "mean_staleness": self._staleness_sum / self._updates if self._updates else 0.0,
            "pushes": {str(r): n for r, n in sorted(self._per_rank.items())},
            "processed": processed}))

    def _apply_loop(self) -> None:
        measurements.local.server = True  # its optimizer steps are not this rank's steps
        while True:
            item = self._queue.get()
            if item is None:
                return
            rank, version, payload = item
            try:
                self._apply(rank, version, payload)
                self._publish()
            except Exception as exc:  # keep serving; say why an update was lost
                sys.__stderr__.write(f"nbdist: parameter server could not apply a push from "
                                     f"rank {rank}: {exc!r}\n")

    def _apply(self, rank: int, version: int, payload: torch.Tensor) -> None:
        self._per_rank[rank] = self._per_rank.get(rank, 0) + 1
        with self._lock:
            staleness = self._updates - version
            if self.max_staleness is not None and staleness > self.max_staleness:
                self._dropped += 1
                return
            for p, g in zip(self._master, self._layout.views(payload)):
                p.grad = g.to(p.device)
            self._opt.step()
            self._updates += 1
        self._staleness_sum += staleness
        self._max_seen = max(self._max_seen, staleness)

    def _receive_loop(self) -> None:
        measurements.local.server = True
        group = self._group
        header = torch.zeros(4, dtype=torch.int64)
        reply = self._layout.buffer()
        while True:
            try:
                work = group.recv_anysource([header], _TAG_HEADER)
                work.wait()
                src = work._source_rank()
                kind, rank, version = (int(v) for v in header[:3])
                if kind == _STOP:
                    return
                if kind == _PUSH:
                    payload = self._layout.buffer()
                    group.recv([payload], src, _TAG_GRADS).wait()
                    self._queue.put((rank, version, payload))
                elif kind == _PULL:
                    with self._lock:
                        self._layout.pack(self._master, reply)
                        current = torch.tensor([self._updates], dtype=torch.int64)
                    group.send([current], src, _TAG_PARAMS).wait()
                    group.send([reply], src, _TAG_PARAMS).wait()
            except Exception as exc:  # the group is gone (re-formed, or a peer died)
                sys.__stderr__.write(f"nbdist: parameter server stops receiving: {exc!r}\n")
                return

    # ----------------------------------------------------------------- workers
    def pull(self, model: torch.nn.Module) -> int:
        """Copy the latest parameters into ``model``; return their version (updates so far)."""
        t0 = time.time()
        nbytes = 0
        if self.rank == self.server_rank:
            with self._lock, torch.no_grad():
                for p, m in zip(model.parameters(), self._master):
                    p.copy_(m)
                version = self._updates
        else:
            header = torch.tensor([_PULL, self.rank, self._version, 0], dtype=torch.int64)
            self._group.send([header], self.server_rank, _TAG_HEADER).wait()
            current = torch.zeros(1, dtype=torch.int64)
            self._group.recv([current], self.server_rank, _TAG_PARAMS).wait()
            self._group.recv([self._recv_buf], self.server_rank, _TAG_PARAMS).wait()
            with torch.no_grad():
                for p, v in zip(model.parameters(), self._layout.views(self._recv_buf)):
                    p.copy_(v)
            version, nbytes = int(current), self._layout.nbytes
        self._version = version
        measurements.on_collective("ps_pull", t0, time.time(), nbytes, _dtype(self._params),
                                blocking=True)
        return version

    def push(self, model: torch.nn.Module) -> None:
        """Send ``model``'s gradients to the server and return: the server applies them when
        it gets to them, to the parameters as they are by then. Ends a training step."""
        t0 = time.time()
        grads = [p.grad for p in model.parameters()]
        nbytes = 0
        if self.rank == self.server_rank:
            payload = self._layout.pack(grads, self._layout.buffer())
            self._queue.put((self.rank, self._version, payload))
        else:
            self._sent()  # the last push's buffer is ours again once gloo has sent it
            self._layout.pack(grads, self._send_buf)
            header = torch.tensor([_PUSH, self.rank, self._version, 0], dtype=torch.int64)
            self._sending = [self._group.send([header], self.server_rank, _TAG_HEADER),
                             self._group.send([self._send_buf], self.server_rank, _TAG_GRADS)]
            nbytes = self._layout.nbytes
        self._store.add("issued", 1)
        self.pushes += 1
        measurements.on_collective("ps_push", t0, time.time(), nbytes, _dtype(self._params),
                                blocking=True)
        if measurements.enabled:
            measurements.end_step("ps")

    def _sent(self) -> None:
        """Wait for this rank's last push to leave. Once only: a gloo send's wait() consumes
        its completion, and a second wait() would block forever."""
        sending, self._sending = self._sending, []
        for work in sending:
            work.wait()

    def stats(self) -> dict[str, Any]:
        """The server's counters now: ``updates`` applied, ``dropped`` (too stale),
        ``max_staleness`` and ``mean_staleness`` of the applied ones, ``pushes`` received per
        rank, and ``processed`` (updates + dropped)."""
        out = json.loads(self._store.get("stats"))
        out["pushes"] = {int(r): n for r, n in out["pushes"].items()}
        return out

    def wait(self, timeout: float = 300.0) -> dict[str, Any]:
        """Block until the server has processed every push made so far by any rank; return
        :meth:`stats`. After training, call it on every rank (after a barrier, so that every
        rank's pushes are made) before reading the counts."""
        self._sent()
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
        """Stop the server; call it on every rank (the first other rank tells the server)."""
        if self._closed:
            return
        self._closed = True
        _open.discard(self)
        self._hook.remove()
        self._sent()
        others = [r for r in range(self._group.size()) if r != self.server_rank]
        if self.rank == self.server_rank:
            self._queue.put(None)
            for t in self._threads:
                t.join(timeout=30)
            # Let the master copy and its optimizer state go now, not at the next GC cycle.
            memory.optimizers.discard(self._opt)
            self._threads, self._master, self._opt = [], [], None
        elif self.rank == others[0]:
            stop = torch.tensor([_STOP, self.rank, 0, 0], dtype=torch.int64)
            self._group.send([stop], self.server_rank, _TAG_HEADER).wait()

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
    if measurements.enabled and torch.is_grad_enabled():
        measurements.count_samples(batch_size(args))
