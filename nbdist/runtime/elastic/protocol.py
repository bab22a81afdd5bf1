"""The protocol of elastic training between the workers and the notebook, spelled once.

The notebook (:mod:`nbdist.elastic.coordinator`) decides who is in the group (it sees which
workers are alive) and writes each membership as a *plan* into the job's rendezvous store,
which lives in a process of the notebook's own so that no rank's death takes it down. Workers
report what happens to them as ``elastic`` events (:class:`~nbdist.telemetry.events.
ElasticWhat`) through the ordinary event channel; the notebook answers through the store, at
the keys the functions below name for one run (``run``: :func:`run_key`):

- :func:`plan_key` ``(run, epoch)``: the membership for ``epoch`` (a pickled :class:`Plan`);
- :func:`join_key` ``(run)``: the epoch a replacement worker waits in, polled by rank 0 at
  commits (``-1``: the notebook gave up on it);
- :func:`arrive_key` ``(run, epoch, worker)``: a member is ready to form ``epoch``'s group.

:class:`Context` is one worker's end of it. State moves between ranks over the process group
itself (:func:`broadcast_bytes`), never through files; a DDP model travels as :class:`Wrapped`.
"""

from __future__ import annotations

import ast
import os
import pickle
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ...telemetry import events
from ...telemetry.events import ElasticWhat
from .. import results

#: how often a rank waiting for the notebook's plan looks at the store
_POLL = 0.02


# ---------------------------------------------------------------------- store keys
def run_key(cell_id: str, index: int) -> str:
    """The store prefix of the ``index``-th ``elastic.run`` call of cell ``cell_id``."""
    return f"nbdist/elastic/{cell_id}/{index}"


def cell_of(run: str) -> str:
    """The cell id a :func:`run_key` was made from."""
    return run.split("/")[-2]


def plan_key(run: str, epoch: int) -> str:
    return f"{run}/plan/{epoch}"


def join_key(run: str) -> str:
    return f"{run}/join"


def arrive_key(run: str, epoch: int, worker: str) -> str:
    return f"{run}/arrive/{epoch}/{worker}"


class ElasticError(RuntimeError):
    """Elastic training stopped: a rank's own error, the failure budget, or nobody to heal
    from. The message says which and what to do."""


@dataclass
class Plan:
    """One membership of the group, decided by the notebook."""

    epoch: int
    generation: int
    #: worker id (as text) -> its RankPlan in this membership
    ranks: dict[str, Any] = field(default_factory=dict)
    #: set instead of ``ranks`` when the run must stop: the reason, for people
    abort: Optional[str] = None
    #: the rank whose own error stopped the run (the others' errors are its consequence)
    stopped_by: Optional[int] = None
    #: failures so far in this run (what ``max_failures`` is checked against)
    failures: int = 0
    #: a replacement worker is coming: rank 0 looks for it at each commit
    join_expected: bool = False
    #: the worker joining in this epoch, if any, and the telemetry slot it takes over
    joiner: Optional[str] = None
    joiner_slot: Optional[int] = None


class Context:
    """What one worker knows about the elastic run it is in (one per ``elastic.run`` call)."""

    def __init__(self, st: Any, key: str, epoch: int = 0, slot: Optional[int] = None) -> None:
        self.worker = st  # the worker's state (runtime.worker.current())
        self.key = key  # the store prefix of this run
        self.epoch = epoch
        self.slot = st.sink.rank if slot is None and st.sink is not None else (slot or 0)
        self.join_expected = False
        self.coordinated = bool(st.coordinated)
        #: the elastic state this worker holds (a replacement receives it while healing)
        self.state: Any = None
        #: what a replacement received besides the commit (see the loop's ``join``)
        self.extras: Optional[dict[str, Any]] = None

    # ------------------------------------------------------------------ store
    @property
    def store(self) -> Any:
        from .. import group

        st = self.worker
        assert st.plan is not None and st.port is not None
        return group.client(st.plan.master_addr, st.port, st.timeout)

    def me(self) -> str:
        assert self.worker.plan is not None
        return str(self.worker.plan.worker_id)

    def emit(self, what: ElasticWhat, **info: Any) -> None:
        sink = self.worker.sink
        if sink is not None:
            sink.emit(events.elastic(what, time.time(), run=self.key, epoch=self.epoch,
                                     worker=self.me(), **info))
            sink.flush()  # the notebook acts on these: never leave them waiting for the timer

    def wait_plan(self, epoch: int, timeout: float) -> Plan:
        """The plan the notebook writes for ``epoch`` (blocks, bounded by ``timeout``)."""
        store, key = self.store, plan_key(self.key, epoch)
        deadline = time.monotonic() + timeout
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise ElasticError(
                    f"the notebook gave no plan for the group within {timeout:g} s; is the "
                    "kernel still running? Restart the cluster with %nbdist restart")
            time.sleep(_POLL)  # a worker waiting on the notebook's decision, not the notebook
        return pickle.loads(store.get(key))

    def arrive(self, plan: Plan, timeout: float) -> Optional[Plan]:
        """Say this worker is ready for ``plan``'s group and wait for every member; returns a
        newer plan instead if the notebook replaced this one meanwhile (a member died)."""
        store = self.store
        store.set(arrive_key(self.key, plan.epoch, self.me()), b"1")
        wanted = [arrive_key(self.key, plan.epoch, w) for w in plan.ranks]
        newer = plan_key(self.key, plan.epoch + 1)
        deadline = time.monotonic() + timeout
        while not store.check(wanted):
            if store.check([newer]):
                return pickle.loads(store.get(newer))
            if time.monotonic() > deadline:
                raise ElasticError(f"members of the new group did not all arrive within "
                                   f"{timeout:g} s")
            time.sleep(_POLL)
        return None

    def form(self, plan: Plan) -> None:
        """Take this worker's rank in ``plan`` and form its group (every member calls it)."""
        from .. import group
        from ..env import apply_env, restore_env

        st = self.worker
        mine = plan.ranks[self.me()]
        old_env = st.env_before
        # Restore what the worker had before nbdist, then apply the new rank's variables.
        restore_env(os.environ, old_env)
        st.env_before = apply_env(os.environ, mine.env(st.port))
        st.plan = mine
        group.form(plan.generation, mine.rank, mine.world_size, st.backend, mine.master_addr,
                   st.port, st.timeout, st.device)
        st.elastic_gen = plan.generation
        st.namespace.update(rank=mine.rank, local_rank=mine.local_rank,
                            world_size=mine.world_size)
        self.epoch = plan.epoch

    def joiner_ready(self) -> Optional[int]:
        """At a commit, while a replacement is expected: the epoch it waits in (agreed by every
        rank through a broadcast from rank 0), or None."""
        import torch
        import torch.distributed as dist

        flag = torch.zeros(1, dtype=torch.int64)
        if dist.get_rank() == 0:
            key = join_key(self.key)
            raw = self.store.get(key) if self.store.check([key]) else b""
            flag[0] = int(raw or 0)
        device = self.worker.device
        t = flag.to(device) if device is not None and device.type == "cuda" else flag
        dist.broadcast(t, 0)
        epoch = int(t.item())
        if epoch < 0:  # the notebook gave up on the replacement
            self.join_expected = False
            return None
        return epoch if epoch > self.epoch else None


#: id(State) -> the loop running its function, which State.commit() tells
active: dict[int, Any] = {}


# ---------------------------------------------------------------------- moving state
class Wrapped:
    """A DistributedDataParallel in transit to a replacement worker: its module and how it
    was built (the loop builds it again on the new group)."""

    def __init__(self, module: Any, kwargs: dict[str, Any]) -> None:
        self.module, self.kwargs = module, kwargs


def broadcast_bytes(blob: Optional[bytes], src: int, device: Any) -> bytes:
    """``blob`` from rank ``src`` to every rank of the default group."""
    import torch
    import torch.distributed as dist

    on = device if device is not None and device.type == "cuda" else torch.device("cpu")
    size = torch.tensor([len(blob) if blob is not None else 0], dtype=torch.int64, device=on)
    dist.broadcast(size, src)
    n = int(size.item())
    if blob is not None:
        buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(on)
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=on)
    dist.broadcast(buf, src)
    return blob if blob is not None else bytes(buf.cpu().numpy().tobytes())


def gather_ints(value: int, device: Any) -> list[int]:
    import torch
    import torch.distributed as dist

    on = device if device is not None and device.type == "cuda" else torch.device("cpu")
    mine = torch.tensor([value], dtype=torch.int64, device=on)
    out = [torch.zeros(1, dtype=torch.int64, device=on) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [int(t.item()) for t in out]


# ---------------------------------------------------------------------- the joiner's cell
def resume_point(filename: str) -> Optional[int]:
    """The line of the cell's top-level statement running now (the one that called the
    elastic function), found by walking up to the cell's module frame."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == filename and frame.f_code.co_name == "<module>":
            return frame.f_lineno
        frame = frame.f_back
    return None


def joiner_source(source: str, line: Optional[int], resume_name: str) -> str:
    """The code a replacement worker runs: the statement at ``line`` with its elastic call
    replaced by ``resume_name()`` (its assignment kept), then the rest of the cell. Line
    numbers stay the cell's own; when the call is not a top-level statement, only the
    resumed function runs."""
    lines = source.splitlines()
    try:
        tree = ast.parse(source)
    except SyntaxError:
        tree = None
    stmt = None
    if tree is not None and line is not None:
        stmt = next((s for s in tree.body if s.lineno <= line <= (s.end_lineno or s.lineno)),
                    None)
    if stmt is None:
        return f"{resume_name}()\n"
    call = f"{resume_name}()"
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and isinstance(stmt.value, ast.Call):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        head = " = ".join(ast.unparse(t) for t in targets)
        call = f"{head} = {resume_name}()"
    end = stmt.end_lineno or stmt.lineno
    rest = lines[end:]
    return "\n" * (stmt.lineno - 1) + call + "\n" * (end - stmt.lineno + 1) + "\n".join(rest)


def picklable_namespace(namespace: dict[str, Any], dumps: Callable[[Any], bytes]
                        ) -> tuple[dict[str, Any], dict[str, str]]:
    """The user's names that can travel to a new worker, and why the others cannot."""
    user = {k: v for k, v in namespace.items()
            if not k.startswith("__") and k not in ("_", "rank", "local_rank", "world_size",
                                                     "device")}
    try:
        dumps(user)
        return user, {}
    except Exception:
        pass
    kept, dropped = {}, {}
    for k, v in user.items():
        try:
            dumps(v)
            kept[k] = v
        except Exception as exc:  # the user's object: say which and why, keep the rest
            dropped[k] = f"{type(exc).__name__}: {exc}"[:200]
    return kept, dropped


def describe_exc(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def is_peer_failure(exc: BaseException) -> bool:
    """A collective failed because a peer is gone (or was cut loose), not the user's code."""
    if isinstance(exc, (KeyboardInterrupt, ElasticError)):
        return False
    return results.is_communication_failure(exc)
