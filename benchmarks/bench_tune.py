"""``%%distributed --tune``: what it chooses, and what that is worth against torch's defaults.

Two model shapes on the same 2 warm workers (gloo, 1 torch thread per rank, SGD, batch 32
per rank): **many small tensors** (48 layers of 64x64, about 200k parameters in 96 tensors)
and **few large ones** (2 layers of 2048x2048, about 8.4M parameters in 4 tensors). For each:

1. ``Session.tune`` on the training cell (``--tune-steps`` optimizer steps per trial): the
   setting it chose, its own speed-up estimate, trials and wall time;
2. torch's defaults against the chosen setting, side by side: ``--rounds`` rounds, each
   running both arms once in alternating order, each arm a ``%%distributed`` cell that times
   ``--steps`` steps after ``--warmup`` (wall clock around the timed steps, slowest rank,
   samples/s = steps x batch x world size / time). Both arms run the same cell, which builds
   ``DDP(model)``: the session's setting is the tuned one in one arm, an empty one (torch's
   own defaults) in the other. Reported: median samples/s of each arm, the median of the
   per-round ratios, and their spread (min-max).

On a loaded machine the figures are indicative only: the ratio of one run's interleaved
arms is the number to read, not absolute samples/s across runs.

    python benchmarks/bench_tune.py [--steps 60] [--rounds 5] [--tune-steps 20]
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

SETUP = """
import time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

SHAPES = {"many-small": (64, 48), "few-large": (2048, 2)}

def make(shape):
    width, depth = SHAPES[shape]
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])

def run(shape, steps, warmup, batch=32):
    model = DDP(make(shape))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    width = SHAPES[shape][0]
    g = torch.Generator().manual_seed(rank)
    data = [torch.randn(batch, width, generator=g) for _ in range(4)]
    for k in range(warmup + steps):
        if k == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        loss = model(data[k % len(data)]).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    took = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return {"samples_per_s": steps * batch * world_size / took.item()}
"""
# The cell --tune runs: it builds its model (each trial its own setting) and trains on.
TUNE_CELL = "run({shape!r}, 10_000, 0)"
SHAPES = ("many-small", "few-large")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="timed steps per arm and round")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tune-steps", type=int, default=20, help="optimizer steps per trial")
    ap.add_argument("--engine", default="ipyparallel")
    ap.add_argument("--timeout", type=float, default=1800)
    args = c.parse_args(ap, argv)

    sys.path.insert(0, c.REPO)
    from nbdist.session import Session

    out: dict[str, Any] = {"benchmark": "tune", "engine": args.engine, "workers": 2,
                           "steps": args.steps, "rounds": args.rounds,
                           "tune_steps": args.tune_steps, "machine": c.machine()}
    rows = []
    with c.deadline(args.timeout):
        s = Session().start(2, engine=args.engine, threads=1, timeout=120)
        try:
            s.run_cell(SETUP, output="quiet")
            for shape in SHAPES:
                out[shape] = part = _shape(s, shape, args)
                rows.append([shape, part["chosen"], f"{part['tune_estimate']:.2f}x",
                             part["trials"], part["tune_s"], part["defaults"], part["tuned"],
                             f"{part['ratio']:.3f}x",
                             f"{part['ratio_min']:.3f}-{part['ratio_max']:.3f}"])
        finally:
            s.stop()
    print(c.table(["shape", "tuned setting", "tune's estimate", "trials", "tune s",
                   "defaults samples/s", "tuned samples/s", "tuned / defaults", "spread"],
                  rows))
    for shape in SHAPES:
        p = out[shape]
        print(f"{shape}: {p['chosen']} is {p['ratio']:.3f}x torch's defaults' samples/s "
              f"(median of {args.rounds} interleaved rounds, {p['ratio_min']:.3f}-"
              f"{p['ratio_max']:.3f})")
    print("RESULT " + json.dumps(out))
    return 0


def _shape(s: Any, shape: str, args: argparse.Namespace) -> dict[str, Any]:
    import time

    from nbdist.runtime.measure.spec import DDPSettings

    s.tune_reset()
    t0 = time.perf_counter()
    result = s.tune(TUNE_CELL.format(shape=shape), args.tune_steps, quiet=True)
    tune_s = time.perf_counter() - t0
    chosen = s.tune_settings()
    c.log(f"{shape}: --tune chose {result.chosen} ({result.trials} trials, {tune_s:.1f} s)")
    # The same cell in both arms: the session's DDP setting is torch's defaults in one (an
    # empty setting: DDP's own defaults, not the same values passed explicitly, which would
    # size DDP's first bucket too), the tuned one in the other.
    arms = {"defaults": DDPSettings(), "tuned": s.tuning.chosen}
    speed: dict[str, list[float]] = {arm: [] for arm in arms}
    for k in range(args.rounds):
        for arm in (("defaults", "tuned") if k % 2 == 0 else ("tuned", "defaults")):
            s.tuning.chosen = arms[arm]
            s.run_cell(f"_bench = run({shape!r}, {args.steps}, {args.warmup})",
                       output="quiet")
            speed[arm].append(s.pull("_bench")["samples_per_s"])
        c.log(f"{shape} round {k + 1}/{args.rounds}: defaults {speed['defaults'][-1]:.0f}, "
              f"tuned {speed['tuned'][-1]:.0f} samples/s")
    ratios = [t / d for t, d in zip(speed["tuned"], speed["defaults"])]
    s.tune_reset()
    return {"chosen": result.chosen, "setting": chosen.given(),
            "tune_estimate": result.speedup or 1.0, "trials": result.trials, "tune_s": tune_s,
            "defaults": statistics.median(speed["defaults"]),
            "tuned": statistics.median(speed["tuned"]), "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "table": [[r.setting, r.samples_per_s, r.step_s, r.note] for r in result.rows]}


if __name__ == "__main__":
    sys.exit(main())
