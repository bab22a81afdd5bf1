"""Telemetry overhead: samples/s of one DDP loop with nbdist's telemetry on vs. off.

Both arms run ``workload.train`` (MLP 784-512-512-10, batch 64 per rank, gloo, 1 torch thread
per rank) as a ``%%distributed`` cell on the same 2 warm workers; only ``telemetry=`` differs.
With telemetry on, every step is timed, DDP's own timer times the gradient all-reduce of a
sample of them (docs/telemetry.md), memory is sampled, and the events stream to the notebook
and are folded by the aggregator, exactly as under a live cell (only the drawing is off:
output is ``quiet``). The arms alternate
in pairs (rotating which goes first); the result is the median of the per-pair ratios
on/off (target >= 0.98), with rank 0's CPU time per run as a second, load-insensitive view.

    python benchmarks/bench_telemetry.py [--steps 300] [--warmup 20] [--pairs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

try:
    from benchmarks import _common as c
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import _common as c  # type: ignore[no-redef]


def cell_code(args: argparse.Namespace) -> str:
    return (
        "import sys\n"
        f"if {c.HERE!r} not in sys.path:\n"
        f"    sys.path.insert(0, {c.HERE!r})\n"
        "import time, workload\n"
        "_cpu = time.process_time()\n"
        f"_bench = workload.train(steps={args.steps}, warmup={args.warmup}, "
        f"batch={args.batch}, seed=0, threads={args.threads})\n"
        "_bench['cpu_s'] = time.process_time() - _cpu\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--engine", default="ipyparallel")
    ap.add_argument("-n", type=int, default=2, help="workers (default 2)")
    args = c.parse_args(ap, argv)

    sys.path.insert(0, c.REPO)
    from nbdist.session import Session

    code = cell_code(args)
    s = Session().start(args.n, engine=args.engine, threads=args.threads, timeout=120)
    results: dict[str, list[float]] = {"on": [], "off": []}
    ratios = []
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    events = 0
    try:
        s.run_cell(code, output="quiet", telemetry=False)  # imports, first DDP: not timed
        for k in range(args.pairs):
            order = ("on", "off") if k % 2 == 0 else ("off", "on")
            got: dict[str, float] = {}
            for arm in order:
                s.run_cell(code, output="quiet", telemetry=arm == "on")
                bench = s.pull("_bench")
                got[arm] = bench["samples_per_s"]
                results[arm].append(got[arm])
                cpu[arm].append(bench["cpu_s"])  # rank 0's process CPU, warm-up included
                if arm == "on":
                    events = sum(len(v) for v in s.runs[-1].events().values())
            ratios.append(got["on"] / got["off"])
            c.log(f"pair {k + 1}/{args.pairs}: on {got['on']:.0f} samples/s, "
                  f"off {got['off']:.0f} samples/s, ratio {ratios[-1]:.3f}")
        snap = s.last_run
    finally:
        s.stop()

    out: dict[str, Any] = {
        "benchmark": "telemetry_overhead", "workers": args.n, "engine": args.engine,
        "steps": args.steps, "batch_per_rank": args.batch, "pairs": args.pairs,
        "samples_per_s_on": statistics.median(results["on"]),
        "samples_per_s_off": statistics.median(results["off"]),
        "ratio_median_of_pairs": statistics.median(ratios),
        "ratio_min": min(ratios), "ratio_max": max(ratios),
        # CPU seconds per run on rank 0: less sensitive than wall time to a loaded machine
        "cpu_ratio_off_over_on": statistics.median(cpu["off"]) / statistics.median(cpu["on"]),
        "events_per_run": events,
        "steps_recorded_per_rank": snap.steps if snap else None,
        "machine": c.machine(),
    }
    print(c.table(["arm", "median samples/s", "runs"],
                  [["telemetry on", out["samples_per_s_on"], len(results["on"])],
                   ["telemetry off", out["samples_per_s_off"], len(results["off"])]]))
    print(f"ratio on/off (median of {args.pairs} pairs): {out['ratio_median_of_pairs']:.3f} "
          f"[{out['ratio_min']:.3f} .. {out['ratio_max']:.3f}], target >= 0.98; "
          f"CPU time off/on {out['cpu_ratio_off_over_on']:.3f}")
    print("RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
