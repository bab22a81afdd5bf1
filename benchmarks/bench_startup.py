"""Cold start: ``%nbdist start -n 2`` until a cell runs, vs torchrun until its first training step.

nbdist side, in an IPython shell: ``%nbdist start -n 2`` (fresh engines, process group
formed, DDP warmed up), then a trivial ``%%distributed`` cell, then the first training cell,
which times its own DDP construction and first optimizer step. torchrun side: launch
``torchrun --nproc_per_node=2 workload.py --mode startup`` and read the wall-clock time at
which its first optimizer step finished, plus the same in-script DDP and first-step timings.
For reference, a plain 2-engine ipyparallel cluster is started the way nbdist starts its own
and timed until its first ``%%px``-style execute returns. The sides alternate ``--repeats``
times after one untimed round that warms the file cache. Besides the timings it prints where
``%nbdist start``'s seconds go (phases) and the CPU each kind of process used until ready.

Then, per engine, heal to full width against torchrun's restart: a rank SIGKILLs itself
mid-training; nbdist's time from the kill to the first step back at full width (a new worker,
forked from the worker template where templates are on, healed from the survivor) against
``torchrun --max-restarts 1`` from the kill to its first step after the restart (the recovery
trials of ``bench_elastic.py``, alternating sides).

    python benchmarks/bench_startup.py --quick     # 1 cold start and 1 heal per side
    python benchmarks/bench_startup.py [--repeats 3] [--heals 3] [--no-prime] [--engine E]
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

try:
    from benchmarks import _common as c
    from benchmarks import bench_elastic
    from benchmarks.bench_training import WORKLOAD
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import _common as c  # type: ignore[no-redef]
    import bench_elastic  # type: ignore[no-redef]
    from bench_training import WORKLOAD  # type: ignore[no-redef]

FIRST_CELL = (
    "import sys\n"
    f"if {c.HERE!r} not in sys.path:\n"
    f"    sys.path.insert(0, {c.HERE!r})\n"
    "import workload\n"
    "_first = workload.first_step(batch={batch}, seed=0, threads={threads})\n"
)


@contextlib.contextmanager
def phases() -> Iterator[dict[str, float]]:
    """Where ``%nbdist start`` spends its seconds: the engine starting its workers (until they
    are registered), then each of the session's own calls to the workers, by what it says it
    does ("describe workers", "form the process group", ...). Timed by wrapping the two
    methods for the duration; what is left is the notebook's own work between them."""
    from nbdist.backends.base import Backend
    from nbdist.group.membership import Membership

    out: dict[str, float] = {}
    start, call = Backend.start, Membership.call

    def timed_start(self: Any, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return start(self, *a, **k)
        finally:
            out["engine starts and registers workers"] = time.perf_counter() - t

    def timed_call(self: Any, calls: Any, timeout: float, what: str) -> Any:
        t = time.perf_counter()
        try:
            return call(self, calls, timeout, what)
        finally:
            out[what] = out.get(what, 0.0) + time.perf_counter() - t

    Backend.start, Membership.call = timed_start, timed_call  # type: ignore[method-assign]
    try:
        yield out
    finally:
        Backend.start, Membership.call = start, call  # type: ignore[method-assign]


#: what a process started for nbdist does, by a piece of its command line (first match)
ROLES = (("store_host", "rendezvous store"), ("nanny", "engine nannies"),
         ("ipyparallel.controller", "controller"), ("ipyparallel.engine", "workers"),
         ("spawn_main", "workers"))


def cpu_by_role(cpu0: float) -> dict[str, float]:
    """CPU seconds so far of every process this one started, by role, and of this process
    since ``cpu0`` (its ``time.process_time()`` when the start began)."""
    import psutil

    out = {"notebook": time.process_time() - cpu0}
    for p in psutil.Process().children(recursive=True):
        try:
            cmd, t = " ".join(p.cmdline()), p.cpu_times()
        except psutil.Error:
            continue
        role = next((r for key, r in ROLES if key in cmd), "other")
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def nbdist_once(ip: Any, args: argparse.Namespace, engine: str) -> dict[str, float]:
    import nbdist

    flags = f"-n {args.workers} --engine {engine} --threads {args.threads} --timeout 120"
    t0 = time.perf_counter()
    w0, cpu0 = time.time(), time.process_time()
    try:
        with phases() as spent:
            ip.run_line_magic("nbdist", f"start {flags}")
        t1 = time.perf_counter()
        spent["rest (notebook)"] = (t1 - t0) - sum(spent.values())
        ip.run_cell_magic("distributed", "--quiet", "x = 1")
        t2 = time.perf_counter()
        cpu = cpu_by_role(cpu0)
        ip.run_cell_magic("distributed", "--quiet",
                          FIRST_CELL.format(batch=args.batch, threads=args.threads))
        t3 = time.perf_counter()
        first = nbdist.current_session().pull("_first")
    finally:
        t4 = time.perf_counter()
        ip.run_line_magic("nbdist", "stop")
        t5 = time.perf_counter()
    return {"start_s": t1 - t0, "trivial_cell_s": t2 - t1, "ready_s": t2 - t0,
            "first_cell_s": t3 - t2, "ddp_s": first["ddp_s"], "step_s": first["step_s"],
            "to_first_step_s": first["first_step_done"] - w0, "stop_s": t5 - t4,
            "cpu_s": sum(cpu.values()),
            **{f"phase: {k}": v for k, v in spent.items()},
            **{f"cpu: {k}": v for k, v in cpu.items()}}


def ipp_once(args: argparse.Namespace) -> dict[str, float]:
    """Reference: a plain ipyparallel cluster started as nbdist starts its own, to first %%px."""
    import logging

    import ipyparallel as ipp

    t0 = time.perf_counter()
    cluster = ipp.Cluster(n=args.workers, controller_ip="127.0.0.1", log_level=logging.WARNING)
    try:
        rc = cluster.start_and_connect_sync()
        rc.wait_for_engines(args.workers, timeout=120)
        t1 = time.perf_counter()
        rc[:].execute("x = 1", block=True)
        t2 = time.perf_counter()
        rc.close()
    finally:
        cluster.stop_cluster_sync()
    return {"registered_s": t1 - t0, "ready_s": t2 - t0}


def torchrun_once(args: argparse.Namespace) -> dict[str, float]:
    def children_cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    t0, cpu0 = time.perf_counter(), children_cpu()
    launch, out, _ = c.run_torchrun(
        WORKLOAD, ["--mode", "startup", "--batch", str(args.batch), "--threads",
                   str(args.threads)], args.workers, timeout=300)
    total = time.perf_counter() - t0
    # torchrun waits for its workers: their CPU is in its own, which is in our children's
    cpu = children_cpu() - cpu0
    r = c.parse_result(out)
    return {"main_s": r["main_started"] - launch, "group_s": r["group_formed"] - launch,
            "ddp_s": r["ddp_s"], "step_s": r["step_s"],
            "to_first_step_s": r["first_step_done"] - launch, "total_s": total,
            "cpu_s": cpu}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--workers", type=int, default=2, help="ranks (2)")
    ap.add_argument("--repeats", type=int, default=3, help="cold starts of each side (3)")
    ap.add_argument("--no-prime", action="store_true",
                    help="skip the untimed first round that warms the file cache")
    ap.add_argument("--batch", type=int, default=64, help="batch per rank (64)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (1)")
    ap.add_argument("--engine", choices=("ipyparallel", "dask"), action="append", default=None,
                    help="nbdist engine(s); repeat for both (default: both)")
    ap.add_argument("--heals", type=int, default=3,
                    help="heal-to-full-width trials per side and engine (3; 0: none)")
    ap.add_argument("--quick", action="store_true",
                    help="one cold start and one heal per side, no priming round")
    ap.add_argument("--timeout", type=float, default=900, help="overall limit, s (900)")
    args = c.parse_args(ap, argv)
    if args.quick:
        args.repeats, args.heals, args.no_prime = 1, 1, True
    engines = list(dict.fromkeys(args.engine or ["ipyparallel", "dask"]))
    if "dask" in engines:
        try:
            import nbdist.backends.dask.adapter  # noqa: F401
        except ImportError as exc:
            c.log(f"dask engine not available ({exc}): skipping it")
            engines.remove("dask")
    args.engines = engines or ["ipyparallel"]
    with c.deadline(args.timeout):
        code = _run(args)
    for engine in args.engines if args.heals > 0 else ():  # each under its own deadline
        c.log(f"heal to full width vs torchrun's restart, {engine}")
        code = code or bench_elastic.main(["--engine", engine, "--skip", "overhead",
                                           "--recoveries", str(args.heals),
                                           "--timeout", str(args.timeout)])
    return code


def _run(args: argparse.Namespace) -> int:
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nbdist")
    once = {f"nbdist {e}": (lambda e=e: nbdist_once(ip, args, e)) for e in args.engines}
    once["torchrun"] = lambda: torchrun_once(args)
    once["ipyparallel"] = lambda: ipp_once(args)
    if not args.no_prime:
        c.log("untimed priming round (file cache)")
        for f in once.values():
            f()
    res: dict[str, list[dict[str, float]]] = {k: [] for k in once}
    names = list(once)
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            r = once[name]()
            res[name].append(r)
            c.log(f"run {rep + 1}/{args.repeats} {name}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in r.items() if k.endswith("_s")))

    def med(side: str, key: str, scale: float = 1.0, unit: str = "") -> str:
        rs = res[side]
        if not rs or key not in rs[0]:
            return "-"
        v = c.median([r[key] for r in rs]) * scale
        return f"{v:.1f} ms" if unit == "ms" else f"{v:.2f}"

    nbs = [f"nbdist {e}" for e in args.engines]
    cols = nbs + ["torchrun", "ipyparallel"]
    spec = [
        (f"%nbdist start -n {args.workers} returns", "start_s", 1.0, ""),
        ("first trivial %%distributed cell", "trivial_cell_s", 1e3, "ms"),
        ("ready: start + trivial cell done", "ready_s", 1.0, ""),
        ("plain ipyparallel: engines registered", "registered_s", 1.0, ""),
        ("torchrun: script main() entered", "main_s", 1.0, ""),
        ("torchrun: process group formed", "group_s", 1.0, ""),
        ("first training cell (wall, notebook side)", "first_cell_s", 1.0, ""),
        ("  first DDP construction (in loop)", "ddp_s", 1e3, "ms"),
        ("  first optimizer step (in loop)", "step_s", 1e3, "ms"),
        ("start/launch -> first step done", "to_first_step_s", 1.0, ""),
        ("stop (nbdist) / launch to exit (torchrun)", "stop_s", 1.0, ""),
        ("CPU s, all processes: to ready (nbdist), launch to exit (torchrun)", "cpu_s", 1.0,
         ""),
    ]
    rows = []
    for label, key, scale, unit in spec:
        row = [label]
        for col in cols:
            k = key
            if col == "torchrun" and key == "stop_s":
                k = "total_s"
            row.append(med(col, k, scale, unit))
        rows.append(row)
    print(f"\ncold start of {args.workers} ranks, gloo, {args.threads} thread/rank, median of "
          f"{args.repeats} alternating runs per side ({c.machine()}); seconds unless marked\n")
    print(c.table(["median"] + cols, rows))
    print("(ipyparallel column: a plain cluster; 'ready' is its first execute returning)\n")
    def breakdown(title: str, what: str, prefix: str) -> None:
        """The medians of every ``prefix``-named figure, one row each, per nbdist engine."""
        keys = list(dict.fromkeys(k for nb in nbs for r in res[nb] for k in r
                                  if k.startswith(prefix)))
        print(f"{title}:\n")
        print(c.table([what] + nbs, [[k[len(prefix):]] + [med(nb, k) for nb in nbs]
                                     for k in keys]))
        print()

    breakdown("where %nbdist start's seconds go (median of each phase)", "phase", "phase: ")
    breakdown("CPU seconds until ready, by process (median; all cores together)", "process",
              "cpu: ")

    def m(side: str, key: str) -> float:
        return c.median([r[key] for r in res[side]])

    first = m("torchrun", "to_first_step_s")
    tr_first = m("torchrun", "ddp_s") + m("torchrun", "step_s")
    for nb in nbs:
        ready = m(nb, "ready_s")
        print(f"cold start ratio {nb} ready / torchrun first step: {ready / first:.2f}x "
              f"({ready:.2f} s vs {first:.2f} s)")
        print(f"cold start ratio {nb} first step / torchrun first step: "
              f"{m(nb, 'to_first_step_s') / first:.2f}x")
        print(f"cold start ratio {nb} ready / plain ipyparallel ready: "
              f"{ready / m('ipyparallel', 'ready_s'):.2f}x")
        nb_first = m(nb, "ddp_s") + m(nb, "step_s")
        print(f"first DDP construction + step ratio {nb}/torchrun: {nb_first / tr_first:.2f}x "
              f"({nb_first * 1e3:.0f} ms vs {tr_first * 1e3:.0f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
