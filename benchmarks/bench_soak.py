"""A long session: memory, cell time and resources over N cells of a user's mix.

One session (the process running this script plays the notebook's kernel) runs ``--cells``
cells in rounds, as a user re-running a notebook does: a training cell (a fresh DDP model, 20
steps, run under one ``--name`` so it replaces its named run; ``--train-repeats`` times in a
row, the round's figure the fastest), a chatty cell
(``--lines`` printed lines on every rank), a failing cell, a push of a ``--push-mb`` MB tensor
under the same name each round, a cell that reads it, a pull, a cell printing a value, plain
cells, and every fifth round a cell that runs past its ``--timeout``. After ``--warmup``
cells, the kernel's and the workers' resident memory (RSS), the processes, threads and file
descriptors are sampled after every round, and the training cell is timed (wall time, as the
notebook sees it). Reported, per engine (each in a fresh child process): RSS growth per 100
cells (least-squares slope of the samples; target <= 20 MiB for the kernel and for the
workers), the training cell's drift (median of its last ``--window`` runs over the first's;
target <= 10 %), processes/threads/fds first vs. last (target: flat), and what the session
says it holds (``Session.held()``). ``--trace`` adds the kernel's top growing allocation
sites (tracemalloc; slows the run).

    python benchmarks/bench_soak.py [--cells 1000] [--warmup 100] [--engine E]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional

try:
    from benchmarks import _common as c
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import _common as c  # type: ignore[no-redef]

ENGINES = ("ipyparallel", "dask")
ROUND = 12  # cells per round of the mix (with the default three training runs)

TRAIN = (
    "import time, torch\n"
    "import torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "_t0 = time.perf_counter()\n"
    "torch.manual_seed(0)\n"
    "model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),\n"
    "                                torch.nn.Linear(256, 10)))\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
    "xs, ys = torch.randn(32, 256), torch.randint(0, 10, (32,))\n"
    "for _ in range(20):\n"
    "    opt.zero_grad()\n"
    "    loss = torch.nn.functional.cross_entropy(model(xs), ys)\n"
    "    loss.backward()\n"
    "    opt.step()\n"
    "losses = [loss.item()]\n"
    "time.perf_counter() - _t0\n"
)
CHATTY = "for _i in range({lines}):\n    print(f'step {{_i}} rank {{rank}} ' + 'x' * 60)\n"
FAILING = "y = 1\nraise ValueError('a failing cell, on purpose')\n"
READ_PUSH = "s = float(data.sum())\n"
SHOW = "losses[-1]\n"
PLAIN = ("x = rank + 1\n", "z = [x] * 100\n")
# Python code a timeout interrupts on both engines (one long native call would have Dask
# restart the worker: another measure)
SLOW = "import time\nwhile True:\n    time.sleep(0.01)\n"
# --trace on the workers: what each one allocated since the warm-up and still holds, and the
# object types that grew
TRACE_START = ("import gc as _gc, tracemalloc as _tm\nfrom collections import Counter as _C\n"
               "_tm.start(8)\n_gc.collect()\n"
               "_types0 = _C(type(o).__name__ for o in _gc.get_objects())\n")
TRACE_END = (
    "_gc.collect()\n"
    "_grown = _C(type(o).__name__ for o in _gc.get_objects())\n_grown.subtract(_types0)\n"
    "_top = ['%+.2f MiB %+d blocks at ' % (s.size / 2**20, s.count) + ' <- '.join(\n"
    "    '%s:%d' % (f.filename.rsplit('/', 2)[-1], f.lineno) for f in list(s.traceback)[-4:])\n"
    "    for s in _tm.take_snapshot().statistics('traceback')[:{n}]]\n"
    "_top.append('objects the garbage collector tracks, most grown: ' + ', '.join(\n"
    "    '%s %+d' % kv for kv in _grown.most_common({n})))\n"
    "_tm.stop()\n"
)


_workers: list[Any] = []


def _procs(s: Any) -> list[Any]:
    """psutil processes of the workers (by the pids status() reports; asked again when one
    of them is gone)."""
    import psutil

    if not _workers or not all(p.is_running() for p in _workers):
        _workers.clear()
        for row in s.status().rows:
            with contextlib.suppress(psutil.Error, TypeError, ValueError):
                _workers.append(psutil.Process(int(row.pid)))
    return list(_workers)


def sample(s: Any) -> dict[str, float]:
    """The kernel's and the workers' RSS (MiB), processes, threads, fds, right now."""
    import psutil

    gc.collect()
    me = psutil.Process()
    workers = _procs(s)
    out = {"kernel_mib": me.memory_info().rss / 2**20,
           "kernel_threads": me.num_threads(), "kernel_fds": me.num_fds(),
           "processes": len(me.children(recursive=True)),
           "workers_mib": 0.0, "worker_threads": 0, "worker_fds": 0}
    for p in workers:
        with contextlib.suppress(psutil.Error):
            out["workers_mib"] += p.memory_info().rss / 2**20
            out["worker_threads"] += p.num_threads()
            out["worker_fds"] += p.num_fds()
    return out


def _types() -> Any:
    """How many objects of each type the garbage collector tracks (objgraph's count)."""
    from collections import Counter

    gc.collect()
    return Counter(type(o).__name__ for o in gc.get_objects())


def slope_per_100(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (cells), times 100."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    """The soak on one engine, in this process; its figures."""
    sys.path.insert(0, c.REPO)
    import torch

    from nbdist.errors import CellTimeoutError, DistributedError
    from nbdist.session import Session

    if args.trace:
        import tracemalloc

        tracemalloc.start(12)
    s = Session().start(args.n, engine=args.engine, threads=1, timeout=120)
    train_ms: list[tuple[int, float]] = []
    kernel_cpu_ms: list[float] = []  # the notebook's CPU time during each training cell
    rank_ms: list[float] = []  # the training cell's time as rank 0 measured it, in the cell
    samples: list[tuple[int, dict[str, float]]] = []
    cells = 0
    failed = timeouts = 0
    snap0: Optional[Any] = None
    types0: Any = None
    sink = io.StringIO()

    def cell(code: str, **kw: Any) -> Any:
        nonlocal cells
        cells += 1
        with contextlib.redirect_stdout(sink):
            return s.run_cell(code, output="rank0", **kw)

    try:
        rnd = 0
        while cells < args.cells:
            runs = []  # (wall, the notebook's CPU, rank 0's own time), ms
            for _ in range(args.train_repeats):
                t0, cpu0 = time.perf_counter(), time.process_time()
                value = cell(TRAIN, name="train")
                runs.append((1e3 * (time.perf_counter() - t0),
                             1e3 * (time.process_time() - cpu0),
                             1e3 * float(repr(value))))  # rank 0's own time of the cell
            if cells > args.warmup:
                # the round's fastest run: what the cell costs, less what other processes
                # on a shared machine took from it while it ran
                wall, cpu, own = min(runs)
                train_ms.append((cells, wall))
                kernel_cpu_ms.append(cpu)
                rank_ms.append(own)
            cell(CHATTY.format(lines=args.lines))
            try:
                cell(FAILING)
            except DistributedError:
                failed += 1
            s.push({"data": torch.randn(args.push_mb * 2**18)})  # float32: 4 bytes each
            cells += 1  # a push is a cell of the notebook (%nbdist push)
            cell(READ_PUSH)
            s.pull("losses", rank=0)
            cells += 1  # %nbdist pull
            cell(SHOW)
            for code in PLAIN:
                cell(code)
            if rnd % 5 == 4:
                try:
                    cell(SLOW, timeout=args.cell_timeout)
                except CellTimeoutError:
                    timeouts += 1
            else:
                cell(PLAIN[0])
            rnd += 1
            sink.seek(0)
            sink.truncate()
            if cells > args.warmup:
                if snap0 is None and args.trace:
                    snap0 = tracemalloc.take_snapshot()
                    types0 = _types()
                    s.run_cell(TRACE_START, output="quiet")
                samples.append((cells, sample(s)))
            if rnd % 10 == 0:
                last = samples[-1][1] if samples else sample(s)
                c.log(f"{args.engine}: {cells} cells, kernel {last['kernel_mib']:.0f} MiB, "
                      f"workers {last['workers_mib']:.0f} MiB, train "
                      f"{train_ms[-1][1] if train_ms else 0:.0f} ms")
        held = str(s.held())
        top: list[str] = []
        if snap0 is not None:
            diff = tracemalloc.take_snapshot().compare_to(snap0, "traceback")
            for d in diff[:args.trace]:
                top.append(f"{d.size_diff / 2**20:+.2f} MiB {d.count_diff:+d} blocks at "
                           + " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}"
                                         for f in list(d.traceback)[-4:]))
            grown = _types()
            grown.subtract(types0)
            top.append("objects the garbage collector tracks, most grown: " + ", ".join(
                f"{k} {v:+d}" for k, v in grown.most_common(args.trace)))
            s.run_cell(TRACE_END.format(n=args.trace), output="quiet")
            top += ["rank 0's worker: " + line for line in s.pull("_top")]
    finally:
        s.stop()
    after_stop = sample_kernel()
    out = summarize(args, train_ms, samples, failed, timeouts, held, top, after_stop)
    w = out["train_window"]
    out.update({"rank_ms_first": c.median(rank_ms[:w]), "rank_ms_last": c.median(rank_ms[-w:]),
                "kernel_cpu_ms_first": c.median(kernel_cpu_ms[:w]),
                "kernel_cpu_ms_last": c.median(kernel_cpu_ms[-w:])})
    return out


def sample_kernel() -> float:
    import psutil

    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def summarize(args: argparse.Namespace, train_ms: list[tuple[int, float]],
              samples: list[tuple[int, dict[str, float]]], failed: int, timeouts: int,
              held: Any, top: list[str], after_stop: float) -> dict[str, Any]:
    xs = [n for n, _ in samples]
    first, last = samples[0][1], samples[-1][1]
    times = [t for _, t in train_ms]
    w = min(args.window, max(1, len(times) // 2))
    head, tail = times[:w], times[-w:]
    out: dict[str, Any] = {
        "benchmark": "soak", "engine": args.engine, "workers": args.n, "cells": args.cells,
        "warmup_cells": args.warmup, "push_mb": args.push_mb, "chatty_lines": args.lines,
        "failed_cells": failed, "timeouts": timeouts, "samples": len(samples),
        "kernel_mib_per_100": slope_per_100(xs, [v["kernel_mib"] for _, v in samples]),
        "workers_mib_per_100": slope_per_100(xs, [v["workers_mib"] for _, v in samples]),
        "kernel_mib_first": first["kernel_mib"], "kernel_mib_last": last["kernel_mib"],
        "kernel_mib_after_stop": after_stop,
        "workers_mib_first": first["workers_mib"], "workers_mib_last": last["workers_mib"],
        "train_ms_first": c.median(head), "train_ms_last": c.median(tail),
        "train_ms_first_p90": c.p90(head), "train_ms_last_p90": c.p90(tail),
        "train_window": w, "train_runs": len(times),
        "drift_pct": 100 * (c.median(tail) / c.median(head) - 1),
        "flat": {k: [first[k], last[k]] for k in
                 ("processes", "kernel_threads", "kernel_fds", "worker_threads",
                  "worker_fds")},
        "held": held, "kernel_top_growth": top, "machine": c.machine(),
    }
    return out


def verdict(r: dict[str, Any]) -> tuple[bool, list[str]]:
    why = []
    if r["kernel_mib_per_100"] > 20:
        why.append(f"kernel grows {r['kernel_mib_per_100']:.1f} MiB per 100 cells (> 20)")
    if r["workers_mib_per_100"] > 20:
        why.append(f"workers grow {r['workers_mib_per_100']:.1f} MiB per 100 cells (> 20)")
    if r["drift_pct"] > 10:
        why.append(f"training cell {r['drift_pct']:+.1f} % slower (> 10 %)")
    for k, (a, b) in r["flat"].items():
        if b > a:
            why.append(f"{k} {a:g} -> {b:g}")
    return not why, why


def report(results: list[dict[str, Any]]) -> bool:
    rows = []
    ok_all = True
    for r in results:
        f = r["flat"]
        rows.append([r["engine"], r["kernel_mib_per_100"], r["workers_mib_per_100"],
                     f"{r['kernel_mib_first']:.0f} -> {r['kernel_mib_last']:.0f} "
                     f"({r['kernel_mib_after_stop']:.0f} stopped)",
                     f"{r['train_ms_first']:.0f} [p90 {r['train_ms_first_p90']:.0f}] -> "
                     f"{r['train_ms_last']:.0f} [p90 {r['train_ms_last_p90']:.0f}]",
                     f"{r['drift_pct']:+.1f} %",
                     " ".join(f"{a:g}->{b:g}" for a, b in f.values())])
    print(c.table(["engine", "kernel MiB/100 cells", "workers MiB/100 cells", "kernel MiB",
                   "train cell ms (median)", "drift",
                   "procs, k.threads, k.fds, w.threads, w.fds"], rows))
    for r in results:
        ok, why = verdict(r)
        ok_all &= ok
        print(f"{r['engine']}: {r['cells']} cells ({r['failed_cells']} failing, "
              f"{r['timeouts']} timed out), after {r['warmup_cells']} warm-up cells: "
              + ("PASS" if ok else "FAIL: " + "; ".join(why))
              + "; targets: <= 20 MiB per 100 cells, drift <= 10 %, resources flat")
        print(f"  the training cell, first vs last {r['train_window']} runs (medians): "
              f"inside the cell on rank 0 {r['rank_ms_first']:.0f} -> {r['rank_ms_last']:.0f} "
              f"ms; the notebook's CPU {r['kernel_cpu_ms_first']:.0f} -> "
              f"{r['kernel_cpu_ms_last']:.0f} ms")
        if r["held"]:
            print(f"  the session held: {r['held']}")
        for line in r["kernel_top_growth"]:
            print(f"  {line}")
    return ok_all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", type=int, default=1000, help="cells in all (default 1000)")
    ap.add_argument("--warmup", type=int, default=100, help="cells before measuring")
    ap.add_argument("--window", type=int, default=20,
                    help="training runs compared at the start and at the end (default 20)")
    ap.add_argument("--train-repeats", type=int, default=3,
                    help="training cells in a row each round; the fastest is the round's "
                         "figure (default 3)")
    ap.add_argument("--push-mb", type=int, default=32, help="the pushed tensor, MB")
    ap.add_argument("--lines", type=int, default=2000, help="lines the chatty cell prints")
    ap.add_argument("--cell-timeout", type=float, default=1.0,
                    help="seconds before the slow cell is stopped")
    ap.add_argument("--engine", choices=ENGINES, action="append", default=None,
                    help="engine (repeat for both; default both)")
    ap.add_argument("-n", type=int, default=2, help="workers (default 2)")
    ap.add_argument("--trace", type=int, default=0,
                    help="print the kernel's top N growing allocation sites (tracemalloc)")
    ap.add_argument("--timeout", type=float, default=7200, help="overall limit, seconds")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = c.parse_args(ap, argv)
    if args.cells < args.warmup + 3 * ROUND:
        ap.error(f"--cells must exceed --warmup by at least three rounds ({3 * ROUND} cells)")
    if args.child:
        args.engine = args.engine[0]
        print("RESULT " + json.dumps(run_engine(args)), flush=True)
        return 0
    results: list[dict[str, Any]] = []
    failed: list[str] = []
    with c.deadline(args.timeout):
        try:
            for engine in args.engine or ENGINES:
                cmd = [sys.executable, os.path.abspath(__file__), "--child", "--engine", engine,
                       *[a for a in (argv if argv is not None else sys.argv[1:])
                         if a not in ENGINES and a != "--engine"]]
                c.log(f"soak on {engine}: {args.cells} cells")
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
                if proc.returncode != 0:
                    failed.append(f"the {engine} soak exited with {proc.returncode} (its "
                                  "error is above)")
                    continue
                results.append(c.parse_result(proc.stdout))
        finally:
            c.kill_children()
    ok = report(results) and not failed
    for line in failed:
        print(f"FAIL: {line}")
    print(f"target: kernel and workers <= 20 MiB per 100 cells, training cell drift <= 10 %, "
          f"processes, threads and fds flat: {'PASS' if ok else 'FAIL'} "
          f"({', '.join(r['engine'] for r in results)})")
    print("RESULT " + json.dumps({"benchmark": "soak", "pass": ok, "engines": results}))
    # as the other benchmarks: a target missed is the verdict above, not an error; an engine
    # whose soak could not run is
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
