"""The loop behind ``nbdist.elastic.run``: call, fail, re-form, heal, call again.

:func:`call` runs on the ranks that start the cell; :func:`join` runs on a replacement worker
the notebook started, which heals from a live peer and then runs the rest of the cell.

A rank's death, on a survivor: the function's collective raises; :meth:`Loop.run` sees a peer
failure and calls :meth:`Loop.recover`, which cuts this rank's group loose (so every peer
fails now, not at the timeout), reports ``failed`` and waits for the notebook's plan of the
next epoch. :meth:`Loop._enter` follows newer plans while members drop out, forms the plan's
group, and :func:`heal` brings every member to the newest commit one of them holds; the loop
then calls the function again from the top.
"""

from __future__ import annotations

import io
import pickle
import sys
import time
from typing import Any, Optional

import cloudpickle

from ...telemetry.events import ElasticWhat
from .. import results
from .protocol import (
    Context,
    ElasticError,
    Plan,
    Wrapped,
    active,
    broadcast_bytes,
    cell_of,
    describe_exc,
    gather_ints,
    is_peer_failure,
    joiner_source,
    picklable_namespace,
    resume_point,
    run_key,
)

RESUME = "__nbdist_elastic_resume__"


class GroupLost(RuntimeError):
    """Forming or healing the new group failed because a member went away."""


class Rejoined(Exception):
    """A replacement joined at this commit: every member starts the function again from the
    top, from the state just committed — where the newcomer starts too."""


class Loop(Context):
    """One ``elastic.run`` call on one worker: ``efn(state, *args, **kwargs)`` until it
    returns, recovering from each peer failure in between (``st``: the worker's state)."""

    def __init__(self, st: Any, efn: Any, state: Any, args: tuple, kwargs: dict, key: str,
                 epoch: int = 0, slot: Optional[int] = None) -> None:
        super().__init__(st, key, epoch, slot)
        self.efn, self.state, self.args, self.kwargs = efn, state, args, kwargs
        self.index = 0  # which elastic.run call of the cell this is
        self.resume_line: Optional[int] = None  # the cell's line that made the call
        self.steps_since_commit = 0
        self._hook: Any = None

    # ------------------------------------------------------------------ running
    def run(self, announce: bool = True) -> Any:
        """Call the function until it returns. A peer's failure (or a group lost while one
        was let in) is recovered from and the function called again from the top; any other
        error is the user's: it stops the run on every rank (see :meth:`_stopped`)."""
        state = self.state
        if state.committed() is None:
            state.commit()  # the starting point is the first thing to come back to
        elif state.unfinished:
            # The last call ended mid-step (an interrupt, an error): what it did after its
            # last commit must not be applied twice.
            number = state.restore()
            print(f"nbdist.elastic: rolled back to commit {number}, where the last call's "
                  "work was last committed")
        state.unfinished = True
        if announce:
            self.emit(ElasticWhat.BEGIN, commit=state.commits, world=_world(),
                      max_failures=self.efn.max_failures, coordinated=self.coordinated)
        active[id(state)] = self
        self._count_steps()
        try:
            while True:
                try:
                    value = self.efn.fn(state, *self.args, **self.kwargs)
                    state.unfinished = False
                    return value
                except Rejoined:
                    continue
                except BaseException as exc:
                    if not (is_peer_failure(exc) or isinstance(exc, GroupLost)):
                        if not isinstance(exc, KeyboardInterrupt):
                            self._stopped(exc)
                        raise
                    if not self.coordinated:
                        raise ElasticError(
                            "a collective failed and this job cannot re-form its group: its "
                            "rendezvous store lives on rank 0's worker because the workers "
                            "cannot reach the notebook's host. Restart with %nbdist restart; "
                            f"the failure was: {describe_exc(exc)}") from exc
                    self.recover(exc)
        finally:
            active.pop(id(state), None)
            if self._hook is not None:
                self._hook.remove()

    def _stopped(self, exc: BaseException) -> None:
        """This rank's own error ends the run: say so, and cut the peers loose now rather than
        after the end-of-cell grace, so that the notebook can stop them too."""
        from .. import group

        self.emit(ElasticWhat.STOPPED, error=describe_exc(exc))
        group.teardown(sever=True)

    def _count_steps(self) -> None:
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
        except ImportError:  # older torch: steps repeated are not counted
            return

        def count(*_: Any) -> None:
            self.steps_since_commit += 1

        self._hook = register_optimizer_step_post_hook(count)

    def on_commit(self) -> None:
        """Called by ``State.commit()``: a consistent point, where a replacement waiting to
        join is let in. Rank 0 reads the join key and every rank learns its answer through a
        broadcast, so all of them enter the new group at the same commit; the function then
        starts again from the top on every member, from that commit (:class:`Rejoined`)."""
        self.steps_since_commit = 0
        if not self.join_expected:
            return
        try:
            epoch = self.joiner_ready()
        except Exception as exc:
            raise GroupLost(f"the group failed while looking for a replacement: {exc}") from exc
        if epoch is None:
            return
        t0 = time.time()
        world_before = _world()
        plan = self.wait_plan(epoch, self.worker.timeout)
        try:
            self._enter(plan)
        except (ElasticError, KeyboardInterrupt):
            raise
        except Exception as exc:  # a member went away while the newcomer was let in
            raise GroupLost(f"the group failed while a replacement joined: {exc}") from exc
        self.emit(ElasticWhat.HEALED, commit=self.state.commits, rolled_back=0, discarded=0,
                  seconds=time.time() - t0, world=_world(), world_before=world_before,
                  failures=plan.failures, joined=plan.joiner)
        raise Rejoined()

    # ------------------------------------------------------------------ recovery
    def recover(self, exc: BaseException) -> None:
        """After a peer failure: leave the group, report, and take this rank's place in the
        notebook's next plan, healed. A member lost while the new group forms is one more
        failure to report, in the same loop."""
        from .. import group

        t0 = time.time()
        world_before = _world(default=None) or self._last_world
        discarded = self.steps_since_commit
        failure: BaseException = exc
        while True:
            group.teardown(sever=True)  # peers blocked on this rank fail now, not at timeout
            self.emit(ElasticWhat.FAILED, commit=self.state.commits,
                      error=describe_exc(failure), world=world_before)
            plan = self.wait_plan(self.epoch + 1, self.worker.timeout)
            try:
                restored = self._enter(plan)
                break
            except (ElasticError, KeyboardInterrupt):
                raise
            except BaseException as again:  # a member went away while the group re-formed
                failure = again
        self.steps_since_commit = 0
        self.emit(ElasticWhat.HEALED, commit=restored,
                  rolled_back=max(0, self.state.commits - restored), discarded=discarded,
                  seconds=time.time() - t0, world=_world(), world_before=world_before,
                  failures=plan.failures, joined=plan.joiner)

    @property
    def _last_world(self) -> int:
        plan = self.worker.plan
        return plan.world_size if plan is not None else 0

    def _enter(self, plan: Plan) -> int:
        """Join ``plan``'s group (following newer plans while members drop out), then heal."""
        while True:
            if plan.abort:
                err = ElasticError(plan.abort)
                err.caused_by_peer = plan.stopped_by is not None  # type: ignore[attr-defined]
                raise err
            if self.me() not in plan.ranks:
                raise ElasticError("this rank was left out of the re-formed group (it did not "
                                   "report in time); the others carried on")
            newer = self.arrive(plan, self.worker.timeout)
            if newer is None:
                break
            plan = newer
        self.form(plan)
        self.join_expected = plan.join_expected
        return heal(self, plan)


def heal(ctx: Context, plan: Plan, *, joining: bool = False) -> int:
    """Bring every member to the newest commit any of them holds, from a live peer over the
    group; rebuild DDP wrappers on the new group. Returns the commit number restored."""
    import torch.distributed as dist

    state = ctx.state
    device = ctx.worker.device
    held = state.committed() if state is not None else None
    mine = held[0] if held is not None else -1
    numbers = gather_ints(mine, device)
    best = max(numbers)
    if best < 0:
        raise ElasticError("no rank that is left holds a committed state to continue from")
    src = numbers.index(best)
    rank = dist.get_rank()
    commit = None
    if any(n != best for n in numbers):
        blob = _dumps(held) if rank == src else None
        blob = broadcast_bytes(blob, src, device)
        if mine != best:  # only ranks behind read it: the others hold the same commit
            commit = pickle.loads(blob)
    extras = None
    if plan.joiner is not None:
        # The cell's names, for the newcomer only: nobody else unpickles them.
        blob = broadcast_bytes(_dumps((sys.path, _dumps(_extras(ctx)))) if rank == src
                               else None, src, device)
        if joining:
            # The peer's import path first: the cell's names may hold functions from modules
            # it imported after extending sys.path (a project folder, say).
            path, payload = pickle.loads(blob)
            sys.path[:0] = [p for p in path if p not in sys.path]
            extras = pickle.loads(payload)
    if joining:
        assert commit is not None and extras is not None
        return _adopt(ctx, commit, extras)
    if commit is not None:
        state.adopt(commit)
    restored = state.restore()
    rewrap(ctx.worker.namespace, state)
    return restored


def _extras(ctx: Any) -> dict[str, Any]:
    """What a replacement worker needs besides the commit: the cell's names, the function,
    the state's objects, and where in the cell to resume."""
    st = ctx.worker
    cell = st.cell or {}
    namespace, dropped = picklable_namespace(st.namespace, _dumps)
    return {"namespace": namespace, "dropped": dropped, "state": ctx.state, "efn": ctx.efn,
            "args": ctx.args, "kwargs": ctx.kwargs, "source": cell.get("source", ""),
            "filename": cell.get("filename", ""), "line": ctx.resume_line, "index": ctx.index,
            "key": ctx.key, "step": _next_step()}


def _next_step() -> int:
    """The index this rank's next training step will get: the members' next step is the
    newcomer's first (a step that collectives opened and no optimizer confirmed yet is it)."""
    from ..measure.model import measurements

    st = measurements.step
    return st.n if st is not None and st.held is not None else measurements.steps


def _adopt(ctx: Any, commit: tuple, extras: dict[str, Any]) -> int:
    state = extras["state"]
    number = commit[0]
    state.adopt(commit)
    ctx.worker.namespace.update(extras["namespace"])
    ctx.extras = extras
    ctx.state = state
    state.restore()
    rewrap(ctx.worker.namespace, state)
    return number


# ---------------------------------------------------------------------- DDP on a new group
def _ddp_kwargs(ddp: Any) -> dict[str, Any]:
    kwargs = {"device_ids": ddp.device_ids, "output_device": ddp.output_device,
              "bucket_cap_mb": ddp.bucket_bytes_cap / (1024 * 1024),
              "find_unused_parameters": ddp.find_unused_parameters,
              "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
              "static_graph": getattr(ddp, "static_graph", False)}
    if not ddp.broadcast_buffers:  # passing the default would raise torch's deprecation warning
        kwargs["broadcast_buffers"] = False
    return kwargs


def rewrap(namespace: dict[str, Any], state: Any) -> int:
    """Build every DDP wrapper of ``state`` and the cell's names again on the new group (in the
    same order on every rank: DDP's construction is collective). Returns how many."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    done: dict[int, Any] = {}

    def new(obj: Any) -> Any:
        if id(obj) in done:
            return done[id(obj)]
        if isinstance(obj, DDP):
            module, kwargs = obj.module, _ddp_kwargs(obj)
        else:
            module, kwargs = obj.module, obj.kwargs
        done[id(obj)] = DDP(module, **kwargs)
        return done[id(obj)]

    for name in state.names:
        value = getattr(state, name)
        if isinstance(value, (DDP, Wrapped)):
            setattr(state, name, new(value))
    for name in sorted(namespace):
        value = namespace[name]
        if isinstance(value, (DDP, Wrapped)):
            namespace[name] = new(value)
    return len(done)


class _Pickler(cloudpickle.CloudPickler):
    def reducer_override(self, obj: Any) -> Any:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if isinstance(obj, DDP):
            return Wrapped, (obj.module, _ddp_kwargs(obj))
        return super().reducer_override(obj)


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _world(default: Optional[int] = 0) -> Optional[int]:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else default


# ---------------------------------------------------------------------- entry points
def call(st: Any, efn: Any, state: Any, args: tuple, kwargs: dict) -> Any:
    """``efn(state, *args, **kwargs)`` with recovery, on a rank that started the cell (``st``:
    the worker's state)."""
    import torch.distributed as dist

    if st.plan is None or st.cell is None or not dist.is_initialized():
        # Not in a %%distributed cell (e.g. the same code under torchrun): no recovery.
        if state.committed() is None:
            state.commit()
        return efn.fn(state, *args, **kwargs)
    index = st.cell["elastic_calls"]
    st.cell["elastic_calls"] = index + 1
    loop = Loop(st, efn, state, args, kwargs, run_key(st.cell["cell_id"], index))
    loop.index = index
    loop.resume_line = resume_point(st.cell["filename"])
    return loop.run()


def join(st: Any, plan: Plan, key: str, slot: int, seq_base: int) -> dict[str, Any]:
    """On a replacement worker that already holds its RankPlan: wait for the survivors at the
    commit boundary, form the group with them, heal from a live peer. Returns what the cell
    must run here (source, filename) or ``{"joined": False, "why": ...}``."""
    ctx = Context(st, key, plan.epoch - 1, slot)
    while True:
        if plan.abort:
            return {"joined": False, "why": plan.abort}
        newer = ctx.arrive(plan, st.timeout)
        if newer is None:
            break
        plan = newer
    ctx.form(plan)
    if st.sink is not None:
        st.sink.rank = slot
        st.sink.seq = max(st.sink.seq, seq_base)  # after the batches of the rank it replaces
    t0 = time.time()
    number = heal(ctx, plan, joining=True)
    extras = ctx.extras
    assert extras is not None
    loop = Loop(st, extras["efn"], ctx.state, extras["args"], extras["kwargs"], key, plan.epoch,
                slot)
    loop.join_expected = plan.join_expected
    loop.index = extras["index"]
    loop.resume_line = extras["line"]
    ctx.epoch = plan.epoch
    loop.emit(ElasticWhat.HEALED, commit=number, rolled_back=0, discarded=0,
              seconds=time.time() - t0, world=_world(), world_before=_world() - 1,
              failures=plan.failures, joined=plan.joiner, step=extras.get("step"))
    st.namespace[RESUME] = lambda: loop.run(announce=False)
    st.cell = {"cell_id": cell_of(key), "filename": extras["filename"],
               "source": extras["source"], "elastic_calls": extras["index"] + 1}
    if extras["dropped"]:
        print("nbdist.elastic: this replacement worker did not receive "
              + "; ".join(f"{k} ({why})" for k, why in extras["dropped"].items()))
    return {"joined": True,
            "source": joiner_source(extras["source"], extras["line"], RESUME),
            "filename": extras["filename"], "rank": plan.ranks[ctx.me()].rank}


def error_result(exc: BaseException, filename: str) -> results.CellResult:
    return results.cell_failed(results.error_info(exc, filename), group_alive=False, seq=0)
