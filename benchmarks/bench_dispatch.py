"""Warm dispatch latency of a trivial cell on 2 workers: ``%%distributed`` vs ``%%px``.

Both sides run ``x = 1`` on every worker and wait for it to finish. nbdist runs on its own
2-engine ipyparallel cluster (through the real magic in an IPython shell, and through
``Session.run_cell``); ``%%px`` runs on a second, plain 2-engine ipyparallel cluster started
the same way, and ``%%pxnb`` (ipyparallel's ``%%px``) runs on nbdist's own engines: the
comparison on the same engines. All variants are timed in shuffled rounds, so slow phases of
a shared machine hit every variant alike. ``--engine dask`` adds nbdist on Dask workers.

Per phase: the engine side of a call is the time between the engine's ``started`` and
``completed`` stamps of its messages (the slowest engine's); the notebook side is the rest
(packing, sending, the reply's trip back, and what the notebook does around them).

    python benchmarks/bench_dispatch.py --quick     # 60 calls each, about a minute
    python benchmarks/bench_dispatch.py [--repeats 200] [--warmup 20] [--engine dask]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import random
import sys
import time
from typing import Any, Callable, Optional

try:
    from benchmarks import _common as c
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import _common as c  # type: ignore[no-redef]

CELL = "x = 1"


def _noop() -> None:
    return None


def dask_available() -> bool:
    try:
        return importlib.util.find_spec("nbdist.backends.dask.adapter") is not None
    except ImportError:
        return False


def _stamp(value: Any) -> Any:
    """An engine's time stamp as a datetime (the client parses some, not all)."""
    if isinstance(value, str):
        from dateutil.parser import isoparse

        return isoparse(value)
    return value


def engine_seconds(client: Any, since: int) -> Optional[float]:
    """The slowest engine's own time (``started`` to ``completed``) on the messages ``client``
    sent after its ``since``-th (None where no engine stamped one)."""
    return _slowest(client.metadata.get(m) or {} for m in client.history[since:])


def _slowest(metadata: Any) -> Optional[float]:
    spans = [(_stamp(md["completed"]) - _stamp(md["started"])).total_seconds()
             for md in metadata if md.get("started") and md.get("completed")]
    return max(spans) if spans else None


class Executed:
    """``view.execute`` of the cell, keeping the engines' stamps of the last call (an
    execute's reply stamps reach its AsyncResult, not the client's metadata)."""

    def __init__(self, view: Any) -> None:
        self.view, self.last = view, None

    def __call__(self) -> None:
        ar = self.view.execute(CELL, block=False)
        ar.get()
        self.last = ar

    def engine_seconds(self) -> Optional[float]:
        return _slowest(self.last._metadata) if self.last is not None else None


def measure(variants: dict[str, Callable[[], Any]], repeats: int, warmup: int,
            seed: int, clients: Optional[dict[str, Any]] = None
            ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Time each variant ``repeats`` times, in a fresh random order every round; for those
    in ``clients`` (variant -> its ipyparallel client), also the engine side of each call."""
    clients = clients or {}
    names = list(variants)
    for _ in range(warmup):
        for n in names:
            variants[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    engine: dict[str, list[float]] = {n: [] for n in clients}
    rng = random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(names)
        for n in names:
            client = clients.get(n)
            since = len(client.history) if client is not None else 0
            t0 = time.perf_counter()
            variants[n]()
            times[n].append(time.perf_counter() - t0)
            if client is not None:
                spent = (variants[n].engine_seconds() if isinstance(variants[n], Executed)
                         else engine_seconds(client, since))
                if spent is not None:
                    engine[n].append(spent)
    return times, engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--workers", type=int, default=2, help="workers per cluster (2)")
    ap.add_argument("--repeats", type=int, default=200, help="timed calls per variant (200)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed calls per variant (20)")
    ap.add_argument("--engine", choices=("ipyparallel", "dask"), action="append",
                    default=None, help="nbdist engine(s) to time; repeat for both "
                    "(default ipyparallel; 'dask' also times ipyparallel for the ratio)")
    ap.add_argument("--timeout", type=float, default=600, help="overall limit, s (600)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="60 calls per variant, 10 warm-up")
    args = c.parse_args(ap, argv)
    if args.quick:
        args.repeats, args.warmup = 60, 10
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    engines = set(args.engine or ["ipyparallel"])
    if "dask" in engines and not dask_available():
        c.log("nbdist.backends.dask.adapter is not available: skipping the dask engine")
        engines.discard("dask")
    engines.add("ipyparallel")

    with c.deadline(args.timeout):
        return _run(args, engines)


def _run(args: argparse.Namespace, engines: set[str]) -> int:
    import ipyparallel as ipp
    from IPython.core.interactiveshell import InteractiveShell

    import nbdist
    from nbdist.session import Session

    n = args.workers
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nbdist")
    px_cluster = None
    dask_session = None
    started = time.perf_counter()
    try:
        c.log(f"starting nbdist on {n} ipyparallel workers")
        ip.run_line_magic("nbdist", f"start -n {n} --timeout 120")
        session = nbdist.current_session()
        nb_view = session.backend.client[:]  # nbdist's own engines, for reference rows

        c.log(f"starting a plain {n}-engine ipyparallel cluster for %%px")
        px_cluster = ipp.Cluster(n=n, controller_ip="127.0.0.1", log_level=logging.WARNING)
        rc = px_cluster.start_and_connect_sync()
        rc.wait_for_engines(n, timeout=120)
        px_view = rc[:]
        px_view.block = True
        rc.activate()  # registers %%px on the shell, targeting all engines, blocking
        nb_view.block = True
        nb_view.activate("nb")  # %%pxnb: ipyparallel's %%px on nbdist's own engines

        variants: dict[str, Callable[[], Any]] = {
            "%%distributed": lambda: ip.run_cell_magic("distributed", "", CELL),
            "%%distributed --quiet": lambda: ip.run_cell_magic("distributed", "--quiet", CELL),
            "%%distributed --quiet --no-telemetry":
                lambda: ip.run_cell_magic("distributed", "--quiet --no-telemetry", CELL),
            "Session.run_cell(output=quiet)": lambda: session.run_cell(CELL, output="quiet"),
            "%%px": lambda: ip.run_cell_magic("px", "", CELL),
            "%%px, nbdist's engines": lambda: ip.run_cell_magic("pxnb", "", CELL),
            "view.execute": Executed(px_view),
            "view.execute, nbdist's engines (the request %%px sends)": Executed(nb_view),
            "view.apply_sync(noop), nbdist's engines": lambda: nb_view.apply_sync(_noop),
        }
        if "dask" in engines:
            c.log(f"starting nbdist on {n} dask workers")
            dask_session = Session().start(n, engine="dask", timeout=120)
            dclient = dask_session.backend.client
            workers = dask_session.backend.worker_ids()

            def dask_raw() -> None:
                futs = [dclient.submit(_noop, workers=[w], pure=False) for w in workers]
                dclient.gather(futs)

            variants["Session.run_cell(output=quiet), dask"] = \
                lambda: dask_session.run_cell(CELL, output="quiet")
            variants["client.submit(noop) x n, dask"] = dask_raw
        c.log(f"clusters up after {time.perf_counter() - started:.1f} s; timing "
              f"{len(variants)} variants x {args.repeats} (+{args.warmup} warm-up)")
        nb_client = session.backend.client
        # every variant on nbdist's ipyparallel engines, and %%px on its own
        clients = {k: nb_client for k in variants if "dask" not in k}
        clients["view.execute"] = rc
        for k in ("%%px", "%%px, nbdist's engines"):  # their engine side: view.execute's
            del clients[k]
        times, engine = measure(variants, args.repeats, args.warmup, args.seed, clients)
    finally:
        c.log("stopping clusters")
        try:
            ip.run_line_magic("nbdist", "stop")
        finally:
            try:
                if dask_session is not None:
                    dask_session.stop()
            finally:
                if px_cluster is not None:
                    px_cluster.stop_cluster_sync()

    ms = {k: (c.median(v) * 1e3, c.p90(v) * 1e3, min(v) * 1e3, max(v) * 1e3)
          for k, v in times.items()}
    print(f"\nwarm dispatch of `{CELL}` on {n} workers, {args.repeats} calls each "
          f"after {args.warmup} warm-up ({c.machine()})\n")
    print(c.table(["variant", "median ms", "p90 ms", "min ms", "max ms"],
                  [(k, *v) for k, v in ms.items()]))
    phases = []
    for k, spans in engine.items():
        if spans:
            eng = c.median(spans) * 1e3
            phases.append((k, ms[k][0], ms[k][0] - eng, eng))
    print("\nper phase, medians (engine: the slowest engine's started..completed)\n")
    print(c.table(["variant", "total ms", "notebook side ms", "engine side ms"], phases))
    same = "%%px, nbdist's engines"
    px_med, px_p90 = ms[same][:2]
    print()
    for name in ("%%distributed", "%%distributed --quiet", "Session.run_cell(output=quiet)"):
        med, q90 = ms[name][:2]
        lo = min(times[name]) / min(times[same])
        print(f"dispatch ratio {name}/%%px (same engines): median {med / px_med:.2f}x, "
              f"p90 {q90 / px_p90:.2f}x, min {lo:.2f}x")
    med = ms["%%distributed"][0]
    verdict = "met" if med / px_med <= 1.0 else "MISSED"
    print(f"target %%distributed <= 1.0x %%px on the same engines: {verdict} "
          f"(median {med:.2f} ms vs {px_med:.2f} ms)")
    if "dask" in engines:
        d = ms["Session.run_cell(output=quiet), dask"][0]
        i = ms["Session.run_cell(output=quiet)"][0]
        print(f"dispatch ratio nbdist dask/ipyparallel (Session.run_cell): {d / i:.2f}x "
              f"({d:.2f} ms vs {i:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
