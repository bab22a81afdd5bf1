"""``nbdist.elastic``'s objects, on the workers: :class:`State` (commit, restore, persist) and
:func:`run`, which hands each call to :mod:`.loop`. The user's guide is :mod:`nbdist.elastic`,
which re-exports them."""

from __future__ import annotations

import copy
import functools
import io
import os
import sys
import time
from typing import Any, Callable, Optional

from .protocol import ElasticError, Wrapped, active, broadcast_bytes, gather_ints

__all__ = ["State", "run", "ElasticFunction", "ElasticError"]

_FILE = "nbdist-elastic-state.pt"


class State:
    """Named training state that can be committed and rolled back.

    ``State(model=model, optimizer=opt, step=0)``: every keyword becomes an attribute. Objects
    with ``state_dict()``/``load_state_dict()`` (modules, optimizers, LR schedulers, grad
    scalers) are committed through those; anything else (numbers, lists, a data position) is
    deep-copied. Attributes set later (``state.epoch = 3``) are committed too.

    :meth:`commit` copies every tensor into a buffer it reuses, so a commit costs one memory
    copy of the model and optimizer state (and holds two such copies). Commit every step for
    small models; for large ones commit every ``k`` steps — a failure then repeats at most
    ``k`` steps.
    """

    def __init__(self, **objects: Any) -> None:
        object.__setattr__(self, "_names", [])
        object.__setattr__(self, "_commit", None)  # (commit number, {name: snapshot})
        object.__setattr__(self, "_spare", None)  # the previous snapshot, reused by the next
        object.__setattr__(self, "_commits", 0)
        object.__setattr__(self, "_persist", None)  # (directory, every)
        object.__setattr__(self, "_unfinished", False)
        for name, obj in objects.items():
            setattr(self, name, obj)

    def __setattr__(self, name: str, value: Any) -> None:
        own = getattr(type(self), name, None)
        if isinstance(own, property) and own.fset is not None:
            object.__setattr__(self, name, value)  # the State's own flag, not an object
            return
        if own is not None and not name.startswith("_"):
            raise AttributeError(f"State.{name} is part of State itself: give this object "
                                 "another name")
        if not name.startswith("_") and name not in self._names:
            self._names.append(name)
        object.__setattr__(self, name, value)

    @property
    def commits(self) -> int:
        """How many commits were made (restored ones included)."""
        return self._commits

    @property
    def names(self) -> tuple[str, ...]:
        """The attributes a commit records, in the order they were set."""
        return tuple(self._names)

    def committed(self) -> Optional[tuple[int, dict[str, Any]]]:
        """The last commit as ``(number, {name: snapshot})``, or None before the first."""
        return self._commit

    def adopt(self, commit: tuple[int, dict[str, Any]]) -> None:
        """Take ``commit`` (from a live peer, or a file :meth:`persist` wrote) as the last
        one; :meth:`restore` then puts the objects back to it. Elastic recovery calls this."""
        object.__setattr__(self, "_commit", commit)
        object.__setattr__(self, "_commits", commit[0])

    @property
    def unfinished(self) -> bool:
        """An elastic function's call on this state has not returned. One that ended mid-step
        (an interrupt, an error) leaves it set: the next call rolls back to the last commit
        first, so that no step after it is applied twice."""
        return self._unfinished

    @unfinished.setter
    def unfinished(self, value: bool) -> None:
        object.__setattr__(self, "_unfinished", value)

    def commit(self) -> None:
        """Record every object's current state as the point to come back to."""
        snap = {name: _snapshot(getattr(self, name), (self._spare or {}).get(name))
                for name in self._names}
        object.__setattr__(self, "_spare", self._commit[1] if self._commit else None)
        object.__setattr__(self, "_commits", self._commits + 1)
        object.__setattr__(self, "_commit", (self._commits, snap))
        if self._persist is not None and self._commits % self._persist[1] == 0:
            self._save(*self._persist)
        ctx = active.get(id(self))
        if ctx is not None:
            ctx.on_commit()

    def restore(self) -> int:
        """Put every object back to the last commit; returns that commit's number."""
        if self._commit is None:
            raise ElasticError("nothing committed yet: call state.commit() first")
        number, snap = self._commit
        for name in self._names:
            if name in snap:
                _load(self, name, snap[name])
        return number

    def persist(self, directory: str, every: int = 100) -> State:
        """Also write every ``every``-th commit to ``directory`` (rank 0 writes, atomically:
        a temporary file, then a rename), for when the kernel or the whole cluster is lost.

        If ``directory`` already holds a commit, it is restored now: rank 0 reads it and
        every rank receives it over the process group. Returns the state.
        """
        if every < 1:
            raise ValueError(f"persist(every={every}): must be at least 1")
        os.makedirs(directory, exist_ok=True)
        object.__setattr__(self, "_persist", (directory, every))
        self._load_persisted(directory)
        return self

    # ------------------------------------------------------------------ files
    def _save(self, directory: str, every: int) -> None:
        import torch

        if _rank() != 0 or self._commit is None:
            return
        path = os.path.join(directory, _FILE)
        tmp = f"{path}.tmp-{os.getpid()}"
        number, snap = self._commit
        torch.save({"commit": number, "state": snap, "saved": time.time()}, tmp)
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one

    def _load_persisted(self, directory: str) -> None:
        import torch

        path = os.path.join(directory, _FILE)
        blob: Optional[bytes] = None
        if _rank() == 0 and os.path.exists(path):
            with open(path, "rb") as f:
                blob = f.read()
        if _distributed():
            has = gather_ints(1 if blob is not None else 0, _device())
            if not has[0]:
                return
            blob = broadcast_bytes(blob, 0, _device())
        if blob is None:
            return
        saved = torch.load(io.BytesIO(blob), weights_only=False)
        self.adopt((saved["commit"], saved["state"]))
        self.restore()
        if _rank() == 0:
            print(f"nbdist.elastic: restored commit {saved['commit']} from {path}")

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        # Travels to a replacement worker with the cell's names; the committed snapshot
        # travels separately and the buffers are rebuilt there.
        return {"names": list(self._names), "objects": {n: getattr(self, n) for n in self._names},
                "commits": self._commits, "persist": self._persist}

    def __setstate__(self, d: dict[str, Any]) -> None:
        State.__init__(self)
        for n in d["names"]:
            setattr(self, n, d["objects"][n])
        object.__setattr__(self, "_commits", d["commits"])
        object.__setattr__(self, "_persist", d["persist"])

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={_short(getattr(self, n))}" for n in self._names)
        return f"State({parts}; {self._commits} commits)"


def run(fn: Optional[Callable[..., Any]] = None, *, max_failures: Optional[int] = None
        ) -> Any:
    """Make ``fn(state, ...)`` survive failures: ``@nbdist.elastic.run`` or
    ``@nbdist.elastic.run(max_failures=K)``.

    After a failure the ranks that are left roll back to the last :meth:`State.commit` and
    call ``fn`` again; after ``max_failures`` failures (default: the profile's
    ``training.elastic.max_failures``, else 3) the cell fails with :class:`ElasticError`.
    """
    if fn is None:
        return lambda f: ElasticFunction(f, max_failures)
    return ElasticFunction(fn, max_failures)


class ElasticFunction:
    """A function wrapped by :func:`run`."""

    def __init__(self, fn: Callable[..., Any], max_failures: Optional[int]) -> None:
        if max_failures is not None and max_failures < 0:
            raise ValueError(f"max_failures={max_failures}: must be 0 or more")
        self.fn = fn
        self.max_failures = max_failures
        functools.update_wrapper(self, fn)

    def __call__(self, state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"{getattr(self.fn, '__name__', 'the function')} decorated with "
                            "nbdist.elastic.run takes an nbdist.elastic.State first, not "
                            f"{type(state).__name__}")
        from .. import worker
        from . import loop

        return loop.call(worker.current(), self, state, args, kwargs)


# ---------------------------------------------------------------------- helpers
def _snapshot(obj: Any, reuse: Any = None) -> Any:
    target = _inner(obj)
    if _has_state_dict(target):
        return ("state_dict", _copy(target.state_dict(), reuse[1] if reuse else None))
    return ("value", copy.deepcopy(obj))


def _load(state: State, name: str, snap: Any) -> None:
    kind, value = snap
    if kind == "state_dict":
        # A copy: optimizers keep the tensors they are given, and the snapshot must stay put.
        _inner(getattr(state, name)).load_state_dict(_copy(value, None))
    else:
        object.__setattr__(state, name, copy.deepcopy(value))


def _inner(obj: Any) -> Any:
    """The module a DDP (or DataParallel) wrapper holds, whose state is what is committed; a
    wrapper travelling to a replacement worker (:class:`Wrapped`) is unwrapped the same way."""
    if isinstance(obj, Wrapped):
        return obj.module
    parallel = sys.modules.get("torch.nn.parallel")  # loaded if obj can be one of its wrappers
    if parallel is not None and isinstance(obj, (parallel.DistributedDataParallel,
                                                 parallel.DataParallel)):
        return obj.module
    return obj


def _has_state_dict(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)) and not isinstance(obj, type)


def _copy(value: Any, reuse: Any) -> Any:
    """A deep copy of a state dict, written into ``reuse`` (the same structure) when given."""
    import torch

    if isinstance(value, torch.Tensor):
        if (isinstance(reuse, torch.Tensor) and reuse.shape == value.shape
                and reuse.dtype == value.dtype and reuse.device == value.device):
            return reuse.copy_(value.detach())
        return value.detach().clone()
    if isinstance(value, dict):
        r = reuse if isinstance(reuse, dict) else {}
        return type(value)((k, _copy(v, r.get(k))) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        r = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(value) else None
        return type(value)(_copy(v, r[i] if r else None) for i, v in enumerate(value))
    return copy.deepcopy(value)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    if _distributed():
        import torch.distributed as dist

        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _device() -> Any:
    from .. import worker

    return worker.current().device


def _short(v: Any) -> str:
    text = repr(v) if isinstance(v, (int, float, str, bool, type(None))) else type(v).__name__
    return text if len(text) < 40 else text[:37] + "..."
