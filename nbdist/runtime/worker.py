"""Entry points the notebook calls on each worker. Stdlib, torch, cloudpickle and psutil only.

Every entry point returns a plain dict built by :mod:`.results` and reports user errors as data
(``ok=False``), so the engine's own error path only ever carries nbdist bugs. Torch and the
group module are imported inside the entry points that need them: the notebook imports this
module to name the functions it ships, and must not load torch for that.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import threading
import time
import types
from typing import Any, Callable, Optional

from ..telemetry.events import figures_interval, flush_interval
from . import debugger, fd_output, node_relay, packing, pulling, results, shared_copy
from .boot import preload
from .capture import EventSink, Transport, captured_output
from .end_marks import end_key
from .env import RankPlan, apply_env, restore_env
from .execute import mimebundle, run_code
from .interrupt import interruptible
from .launched import launch_env, launched, start_environment
from .measure.spec import DEFAULT, Measure
from .measure.stall_probe import enable_flight_recorder, watching
from .rich_output import capturing, figure_png


class WorkerState:
    """Everything one worker keeps between cells."""

    def __init__(self) -> None:
        #: the cells' ``__main__``, as a script's or IPython's is: pickle finds the classes and
        #: functions they define by reference (a Pool's tasks, torch.save), once a rank joins
        self.main = types.ModuleType("__main__")
        self.namespace: dict[str, Any] = self.main.__dict__
        self.namespace["__builtins__"] = __builtins__
        self.plan: Optional[RankPlan] = None
        self.env_before: dict[str, Optional[str]] = {}
        self.cwd_before: Optional[str] = None
        self.port: Optional[int] = None
        self.device: Any = None
        self.backend: Optional[str] = None
        self.timeout: float = 300.0
        self.sink: Optional[EventSink] = None
        self.transport: Optional[Transport] = None
        self.lock = threading.Lock()
        #: the running cell (cell_id, filename, source, elastic_calls), for elastic training
        self.cell: Optional[dict[str, Any]] = None
        #: the notebook coordinates elastic recovery (it hosts the store)
        self.coordinated = False
        #: set when an elastic run re-formed the group during the running cell
        self.elastic_gen: Optional[int] = None


_state = WorkerState()
#: how torch's NCCL groups handle a collective that failed or timed out
NCCL_ERRORS = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def current() -> WorkerState:
    """This worker's state: what the runtime's other modules (elastic training) read."""
    return _state


def describe(controller_ip: Optional[str] = None, gpus: bool = True) -> results.WorkerInfo:
    """What this worker knows about its host, without touching CUDA; ``gpus=False`` leaves
    out the GPU count and with it torch's import (the notebook's own description)."""
    if gpus:
        preload.wait()  # torch is being imported at the worker's start: not beside it
    addresses: list[results.Address] = []
    try:
        import psutil

        for iface, addrs in psutil.net_if_addrs().items():
            for a in addrs:
                if a.family == socket.AF_INET:
                    mask = a.netmask or "255.255.255.255"
                    prefix = sum(bin(int(x)).count("1") for x in mask.split("."))
                    addresses.append(results.Address(ip=a.address, prefix=prefix,
                                                     iface=iface))
    except ImportError:
        pass
    route_ip = None
    if controller_ip:
        # The source address the kernel routes towards the controller: reachable by design.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((controller_ip, 9))
                route_ip = s.getsockname()[0]
            except OSError:
                pass
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return results.WorkerInfo(hostname=socket.gethostname(), pid=os.getpid(), cpu_count=cpus,
                              gpu_count=_gpu_count() if gpus else 0, addresses=addresses,
                              route_ip=route_ip, python=sys.executable)


def _gpu_count() -> int:
    import torch

    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def set_transport(transport: Transport) -> None:
    _state.transport = transport
    if _state.sink is not None:
        _state.sink.transport = transport


def open_store(host: str, purpose: str = "cluster", timeout: float = 300.0) -> int:
    from . import group

    return group.open_store(host, purpose, timeout)


def close_store(purpose: str) -> None:
    from . import group

    group.close_store(purpose)


def join(plan: RankPlan, port: int, device: str, dist_backend: str, timeout: float,
         gen: int, warm: bool = True, working_dir: Optional[str] = None,
         form: bool = True) -> results.Joined:
    """Take ``plan``'s rank: set torchrun's env, pin threads and GPU, form the group, warm up.

    With ``working_dir``, cells run there (the previous directory comes back on leave).
    """
    preload.wait()
    import torch

    from . import group

    leave()
    if working_dir:
        if not os.path.isdir(working_dir):
            raise FileNotFoundError(f"working_dir {working_dir!r} is not a directory on "
                                    f"{socket.gethostname()}")
        _state.cwd_before = os.getcwd()
        os.chdir(working_dir)
    _state.plan = plan
    _state.port = port
    _state.timeout = timeout
    cell_env = plan.env(port)
    # Cells run in this long-lived process: on an NCCL error or timeout, abort the
    # communicator and raise in the cell (2) rather than end the process and its namespace
    # (torch's default, 3). A value set here or in the profile stands.
    cell_env.setdefault(NCCL_ERRORS, os.environ.get(NCCL_ERRORS, "2"))
    # Without the variables a Jupyter kernel sets for its own display (FORCE_COLOR, ...): a
    # rank's libraries see what they see under torchrun (:mod:`.launched`)
    _state.env_before = apply_env(os.environ, {**launch_env(os.environ, start_environment()),
                                               **cell_env})
    _adaptive_malloc()
    _plain_process()
    fd_output.install()  # each rank process its own files: a fork's are not its parent's
    torch.set_num_threads(plan.threads)
    if device == "cuda" or (device == "auto" and plan.gpu is not None):
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device cuda asked, but {plan.hostname} has no CUDA device")
        torch.cuda.set_device(plan.gpu or 0)
        _state.device = torch.device("cuda", plan.gpu or 0)
    else:
        _state.device = torch.device("cpu")
    _state.backend = group.resolved_backend(dist_backend, _state.device)
    if _state.sink is None:
        _state.sink = EventSink(plan.rank, _state.transport, sealed=True)
    _state.sink.rank = plan.rank
    _state.sink.interval = flush_interval(plan.world_size)  # fewer batches from big jobs
    _state.sink.figures_interval = figures_interval(plan.world_size)
    group.install_guard()
    from .measure import ddp_hooks, parallel_hooks, tqdm_bars

    ddp_hooks.install()  # DDP and collective timing; each cell switches it on or off
    parallel_hooks.install()  # pipelines, DTensor's collectives, mesh dimensions
    tqdm_bars.install()  # tqdm loops in cells report as bars, like nbdist.progress
    enable_flight_recorder()  # before the first group: torch reads its size then
    t0 = time.perf_counter()
    if form:  # a replacement worker forms its group with the survivors, when they get there
        group.form(gen, plan.rank, plan.world_size, _state.backend, plan.master_addr, port,
                   timeout, _state.device)
    t_group = time.perf_counter() - t0
    if warm:
        _warm_up()
    _state.namespace.update(rank=plan.rank, local_rank=plan.local_rank,
                            world_size=plan.world_size, device=_state.device)
    return results.Joined(rank=plan.rank, device=str(_state.device), backend=_state.backend,
                          threads=plan.threads, group_s=t_group,
                          warm_s=time.perf_counter() - t0 - t_group)


_plain_pid = 0  # the process made to look like a plain one to the cells


def _plain_process() -> None:
    """Once per process, before its first cell: what a cell sees of its process is what a
    script sees under torchrun.

    * The cells' namespace is ``sys.modules["__main__"]``, so a class defined in a cell
      pickles by reference, as in a script or a Jupyter kernel (``Pool.map`` with it).
    * The default multiprocessing start method is the platform's (fork on Linux before Python
      3.14). A process that multiprocessing started (a Dask worker, from its nanny's
      forkserver or by spawn) has its parent's method forced as its own default, and a
      ``DataLoader``'s workers would then pickle a Dataset class defined in a cell.

    Later joins leave both as the cells may have set them.
    """
    global _plain_pid
    import multiprocessing

    if _plain_pid == os.getpid():
        return
    _plain_pid = os.getpid()
    sys.modules["__main__"] = _state.main
    if multiprocessing.parent_process() is not None:
        multiprocessing.set_start_method(None, force=True)  # the platform's default again


#: mallopt's parameters (glibc's malloc.h) and the values glibc's adaptive thresholds reach
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_MAX = 32 << 20
_malloc_done = False


def _adaptive_malloc() -> None:
    """Undo ``MALLOC_TRIM_THRESHOLD_`` in a worker that Dask's nanny started with it (an
    existing Dask cluster: the workers nbdist starts never get it).

    Setting it turns glibc's adaptive mmap threshold off, so each tensor over 128 KiB is
    mapped on allocation and unmapped on free, and every step page-faults through its
    activations and buckets again (about 1.3x a step's CPU on a small MLP). The thresholds
    are set where glibc's adaptive ones end up; memory freed by training is then reused
    rather than handed back to the system at once.
    """
    global _malloc_done
    if _malloc_done or "MALLOC_TRIM_THRESHOLD_" not in os.environ or \
            not sys.platform.startswith("linux"):
        return
    _malloc_done = True
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_MAX)
    except (OSError, AttributeError):  # not glibc: nothing to undo
        pass


def _warm_up() -> None:
    """Pay DDP's first-use cost (imports, reducer set-up) now instead of in the first cell."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = torch.nn.Linear(4, 2).to(_state.device)
    ddp = DDP(model, device_ids=[_state.device.index] if _state.device.type == "cuda" else None)
    ddp(torch.zeros(2, 4, device=_state.device)).sum().backward()
    del ddp, model


def leave() -> None:
    """Drop the rank: tear the group down and restore the environment."""
    from . import group

    group.teardown()
    restore_env(os.environ, _state.env_before)
    _state.env_before = {}
    _state.plan = None
    if _state.cwd_before is not None:
        os.chdir(_state.cwd_before)
        _state.cwd_before = None


def run_cell(source: str, filename: str, cell_id: str, gen: int, peers: list[int],
             want_result: Optional[bool], grace: float = 3.0, measure: Measure = DEFAULT,
             coordinated: bool = False, slot: Optional[int] = None,
             keep_cell: bool = False, link: Optional[debugger.Link] = None,
             mark_end: bool = True) -> results.CellResult:
    """Run one cell on this rank, among ``peers`` (``want_result`` None: the lowest returns).

    ``measure``: what the cell measures (telemetry switches, the hang doctor's threshold);
    ``coordinated``: the notebook re-forms the group when an ``nbdist.elastic.run`` call
    fails; ``slot``: the rank this worker's events report as (a replacement worker takes the
    slot of the rank it replaces); ``link``: how the cell's debugger reaches the notebook;
    ``mark_end`` False: the notebook marks this rank's end if it succeeds (:mod:`.end_marks`)."""
    from ..telemetry import events
    from . import group
    from .measure import tuning
    from .measure.model import measurements

    plan = _state.plan
    if plan is None:
        return results.cell_failed(results.plain_error(
            "RuntimeError", "worker has no rank",
            "this worker has not joined the job; run %nbdist restart"), group_alive=False, seq=0)
    full = len(peers) == plan.world_size
    me = plan.rank if slot is None else slot
    want_result = me == min(peers, default=-1) if want_result is None else want_result
    with _state.lock:
        t0 = time.perf_counter()
        seq0 = _state.sink.flush()
        _state.sink.stagger(plan.node_rank / max(1, plan.num_nodes))
        _state.sink.rank = me
        # The notebook shows the lowest rank's output: it goes out at the next tick, however
        # large the job (others wait for the rank's next batch)
        _state.sink.prompt_output = _state.sink.rank == min(peers, default=_state.sink.rank)
        _state.coordinated = coordinated
        if not keep_cell or _state.cell is None:
            _state.cell = {"cell_id": cell_id, "filename": filename, "source": source,
                           "elastic_calls": 0}
        group.release_destroyed()
        if full and group.generation() != gen:
            # A failure or a user's destroy_process_group() left the group gone or stale.
            try:
                group.form(gen, plan.rank, plan.world_size, _state.backend, plan.master_addr,
                           _state.port, _state.timeout, _state.device)
            except Exception as exc:
                err = results.error_info(exc, filename, communication=True,
                                         evalue=f"could not re-form the process group: {exc}")
                return results.cell_failed(err, group_alive=False, seq=_state.sink.flush())
        if slot is None or slot == plan.rank:  # a replacement's host is not its slot's
            _relay_batches(_state.sink, plan, cell_id, peers)
        out = results.cell_ok()
        measurements.begin_cell(_state.sink, measure)
        tuning.begin_cell(_state.sink, measure)
        with interruptible(group.sever) as watch, captured_output(_state.sink, filename=filename), \
                watching(_state.sink, filename, measure.telemetry, measure.stall_after):
            try:
                with debugger.debugging(link, _state.sink, filename, _debug_store), \
                        launched(), capturing(_state.sink):
                    value = run_code(source, filename, _state.namespace)
                if want_result:
                    out["value"] = mimebundle(value)
                    png = figure_png(value)  # a matplotlib figure as the value: its image
                    if png is not None and out["value"] is not None:
                        out["value"]["image/png"] = png
            except tuning.TrialDone:
                pass  # a tuning trial took its steps: every rank cut the cell at the same one
            except BaseException as exc:  # the user's error is data for the notebook
                err = results.error_info(exc, filename, communication=True if watch.severed
                                         else None)
                out = results.cell_failed(err)
                if err["communication"]:  # a collective failed: this group cannot be trusted
                    group.teardown(sever=True)
        if watch.severed:  # an interrupt cut this rank out of a collective: the group is gone
            group.teardown()
        try:
            measurements.end_cell()
            tuning.end_cell()
        except Exception as exc:  # a telemetry bug must never fail the user's cell
            sys.__stderr__.write(f"nbdist: telemetry error: {exc!r}\n")
        err = out["error"]
        _state.sink.emit(events.end(out["ok"], time.time(),
                                    f"{err['ename']}: {err['evalue']}" if err else None))
        seconds = time.perf_counter() - t0
        if len(peers) > 1:
            if mark_end or not out["ok"]:
                group.mark_done(end_key(cell_id, plan.rank))
            if not out["ok"] and group.generation() is not None:
                others = [end_key(cell_id, r) for r in peers if r != plan.rank]
                if not group.wait_for_peers(others, grace):
                    # Peers are still running and may wait on us in a collective forever:
                    # closing our side of the group makes their collective fail now.
                    group.teardown(sever=True)
        # The last batch (the end event, the last steps) rides in the result: the notebook
        # then waits for no event message after the results.
        _state.sink.end_relay()
        seq, tail = _state.sink.end_call(seq0)
        _state.cell = None
        alive = group.generation() is not None and (group.generation() == gen
                                                    or _state.elastic_gen is not None)
        out["elastic_gen"] = _state.elastic_gen
        out["rank"] = plan.rank if _state.plan is None else _state.plan.rank
        _state.elastic_gen = None
        return results.finish(out, seconds=seconds, group_alive=alive, seq=seq, tail=tail)


def _relay_batches(sink: EventSink, plan: RankPlan, cell_id: str, peers: list[int]) -> None:
    """During this cell, the ranks of this host that run it send their batches through the
    lowest of them (:mod:`.node_relay`): one message per host for the notebook. A relay that
    cannot bind leaves its peers sending their own, as they do when it is not there yet."""
    sink.end_relay()  # a cell that ended before its own could
    here = node_relay.host_ranks(plan.rank, plan.local_rank, plan.local_world_size, peers)
    relay = node_relay.relay_for(here, plan.rank)
    if relay is None or sink.transport is None:
        return
    try:
        path = node_relay.relay_path(cell_id, relay)
        if relay == plan.rank:
            sink.relay = node_relay.Relay(path, len(here) - 1,
                                          max(sink.interval, sink.figures_interval))
        else:
            sink.peer = node_relay.Peer(path)
    except OSError as exc:  # no relay: every rank sends its own batches, as without one
        sys.__stderr__.write(f"nbdist: rank {plan.rank} sends its own events: {exc}\n")


def _debug_store() -> Any:
    """The job's store, where the notebook writes the debugger's answers."""
    assert _state.plan is not None and _state.port is not None
    return debugger.store_client(_state.plan.master_addr, _state.port, _state.timeout)


def post_mortem(link: debugger.Link) -> results.CellResult:
    """``%nbdist debug`` on this worker: pdb on its last failed cell (:mod:`.debugger`)."""
    assert _state.sink is not None
    with _state.lock:
        return debugger.post_mortem_call(link, _state.sink, _debug_store)


def push(header: bytes, layout: Optional[list], *buffers: Any,
         source: Optional[tuple] = None) -> None:
    """Put the values :func:`~.packing.pack` packed (a dict) into the namespace; their buffers
    come with the call, or from the notebook's shared copy on this machine, or over its data
    channel (``source``: the channel's address, the push's ticket, the shared copy's spec,
    and the fingerprint of the channel's TLS certificate or None where it is plain TCP)."""
    if source is not None:
        address, ticket, shared, tls = source
        views = shared_copy.attach(shared, ticket) if shared is not None else None
        buffers = (tuple(views) if views is not None
                   else tuple(packing.fetch(tuple(address), ticket, _state.timeout, tls)))
    _state.namespace.update(packing.unpack(header, buffers, layout))


def pull(name: str, sink: Optional[tuple] = None) -> list[Any]:
    """``name`` (a dotted path) from the namespace, with tensors and modules on CPU, packed
    for the notebook (:func:`.pulling.pull`, which says the shapes of the answer and of
    ``sink``)."""
    return pulling.pull(_state.namespace, name, sink, _state.timeout)


def run_script(script: str, source: str, argv: list[str], port: int, cwd: str,
               run_id: str = "nbdist") -> results.CellResult:
    """Run a torchrun-style script in a fresh process with this rank's torchrun environment:
    the variables torchrun's agent sets, a per-run id and a per-rank error file."""
    from .script import error_file, run

    assert _state.plan is not None and _state.sink is not None
    env = _state.plan.env(port, run_id=run_id)
    env["TORCHELASTIC_ERROR_FILE"] = error_file(run_id, _state.plan.rank)
    if NCCL_ERRORS not in _state.plan.extra:  # a script's own process: torchrun's default
        env[NCCL_ERRORS] = _state.env_before.get(NCCL_ERRORS) or "1"
    _state.sink.prompt_output = _state.plan.rank == 0  # a script's view shows rank 0
    return run(script, source, argv, env, cwd, _state.sink)


def status() -> results.WorkerStatus:
    from . import group

    plan = _state.plan
    mem = None
    try:
        import psutil

        mem = psutil.Process().memory_info().rss
    except ImportError:
        pass
    return results.WorkerStatus(rank=plan.rank if plan else None, hostname=socket.gethostname(),
                                pid=os.getpid(),
                                device=str(_state.device) if _state.device else None,
                                group=group.generation() is not None, rss=mem)


def elastic_join(plan: RankPlan, port: int, device: str, dist_backend: str,
                 timeout: float, elastic_plan: Any, key: str, slot: int, seq_base: int,
                 want_result: bool, measure: Measure = DEFAULT) -> results.CellResult:
    """On a replacement worker: take ``plan``'s rank without forming a group, join the
    survivors of an elastic run at a commit, heal from a live peer, then run the rest of the
    cell as every rank does."""
    from .elastic import loop

    try:
        join(plan, port, device, dist_backend, timeout, gen=-1, warm=False, form=False)
        _state.coordinated = True
        if _state.sink is not None:
            _state.sink.rank = slot
        step = loop.join(_state, elastic_plan, key, slot, seq_base)
    except BaseException as exc:  # reported like a cell's error, for this rank
        return results.cell_failed(results.error_info(exc, "<elastic join>"),
                                   group_alive=False, seq=_state.sink.flush() if _state.sink
                                   else 0)
    if not step["joined"]:
        return results.not_joined(step["why"], _state.sink.flush() if _state.sink else 0)
    from . import group

    gen = group.generation()
    world = _state.plan.world_size if _state.plan else 1
    return run_cell(step["source"], step["filename"], _state.cell["cell_id"], gen,
                    list(range(world)), want_result, measure=measure, coordinated=True,
                    slot=slot, keep_cell=True)


#: the names nbdist puts in every rank's namespace
PREDEFINED = ("rank", "local_rank", "world_size", "device")


def defined_names() -> list[str]:
    """The names cells defined on this worker (modules, private names and nbdist's own left
    out): what a restart of its process loses. Safe to call beside a running cell."""
    return sorted(k for k, v in list(_state.namespace.items())
                  if not k.startswith("_") and k not in PREDEFINED
                  and not isinstance(v, types.ModuleType))


#: an import: the name it binds, the module, and the attribute path in it ("" for the module)
Import = tuple[str, str, str]


def imports_in(namespace: dict[str, Any]) -> list[Import]:
    """The names in ``namespace`` that an import binds and a fresh process can bind again:
    modules (``import numpy as np``, ``from torch import nn``) and classes and functions found
    under their own module and qualified name (``from torch.utils.data import DataLoader``).
    Reads no attribute that runs code (safe beside a running cell); a module the process made
    itself, or an object another module merely holds, is not an import."""
    found = []
    for name, value in list(namespace.items()):
        if name.startswith("__") or name in PREDEFINED:
            continue
        if isinstance(value, types.ModuleType):
            module = value.__dict__.get("__name__")
            if isinstance(module, str) and module not in _MAINS \
                    and sys.modules.get(module) is value:
                found.append((name, module, ""))
            continue
        if not isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
            continue
        module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
        if not isinstance(module, str) or not isinstance(qualname, str) or module in _MAINS:
            continue
        owner: Any = sys.modules.get(module)
        for part in qualname.split("."):
            owner = vars(owner).get(part) if isinstance(owner, (types.ModuleType, type)) else None
        if owner is value:
            found.append((name, module, qualname))
    return sorted(found)


_MAINS = ("__main__", "__mp_main__")  # defined in cells or a script: not importable


def reimport(namespace: dict[str, Any], imports: list[Import]) -> dict[str, str]:
    """Bind each of ``imports`` (from :func:`imports_in`) in ``namespace`` again, as the import
    statement did; returns why, for each name that could not be."""
    failed = {}
    for name, module, attr in imports:
        try:
            value: Any = importlib.import_module(module)
            for part in attr.split(".") if attr else ():
                value = getattr(value, part)
        except Exception as exc:  # the user's module: say why, bind the others
            failed[name] = f"{type(exc).__name__}: {exc}"
            continue
        namespace[name] = value
    return failed


def namespace_held() -> dict[str, Any]:
    """What a restart of this process would lose, for the notebook to say and restore:
    ``{"names": [...], "imports": [...]}``, the names cells defined that are not imports, and
    the imports (:func:`imports_in`). Safe to call beside a running cell."""
    imports = imports_in(_state.namespace)
    bound = {name for name, _, _ in imports}
    return {"names": [k for k in defined_names() if k not in bound], "imports": imports}


def restore_imports(imports: list[Import]) -> dict[str, str]:
    """In a fresh process that took a restarted rank's place: import again what the old
    namespace had imported (:func:`namespace_held`); returns why, for each name not bound."""
    preload.wait()  # not beside the start-up imports: import locks
    return reimport(_state.namespace, [tuple(i) for i in imports])  # type: ignore[misc]


def call_in_namespace(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(namespace, *args)``; for extensions that need the cell namespace."""
    return fn(_state.namespace, *args)
