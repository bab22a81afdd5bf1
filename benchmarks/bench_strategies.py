"""Training strategies side by side: samples/s and memory per rank as ratios to plain DDP.

The same MLP (784-512-512-512-10, Adam, batch 64 per rank, 1 torch thread per rank) trains on
the same 2 warm workers as DDP, DDP + fp16 compression, ZeRO-1 (ZeroRedundancyOptimizer) and
FSDP2 (fully_shard per layer), each a named ``%%distributed`` run, in rounds that rotate the
order. Samples/s is the median over rounds of each run's own timing (wall clock around the
timed steps on rank 0); memory is what nbdist's telemetry reports per rank. A second part
times FSDP2 with telemetry on vs. off in alternating pairs (target >= 0.97).

PowerSGD is left out here: on gloo, torch's hook stops making progress once gradients span
more than one DDP bucket, which this model does (see docs/strategies.md).

    python benchmarks/bench_strategies.py [--steps 60] [--rounds 3] [--pairs 5]
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
import time, torch, nbdist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.fsdp import fully_shard
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

def make():
    torch.manual_seed(0)
    dims = [784, 512, 512, 512, 10]
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])

def build(strategy):
    if strategy == "fsdp2":
        m = make()
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=nbdist.mesh())
        fully_shard(m, mesh=nbdist.mesh())
        return m, torch.optim.Adam(m.parameters(), lr=1e-3)
    m = DDP(make())
    if strategy == "fp16":
        m.register_comm_hook(None, default_hooks.fp16_compress_hook)
    if strategy == "zero1":
        return m, ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.Adam,
                                          lr=1e-3)
    return m, torch.optim.Adam(m.parameters(), lr=1e-3)

def run(strategy, steps, warmup, batch=64):
    m, opt = build(strategy)
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(8)]
    for k in range(warmup + steps):
        if k == warmup:
            t0 = time.perf_counter()
        x, y = data[k % len(data)]
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"samples_per_s": batch * world_size * steps / (time.perf_counter() - t0)}
"""

STRATEGIES = ("ddp", "fp16", "zero1", "fsdp2")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=5, help="FSDP2 telemetry on/off pairs")
    ap.add_argument("--engine", default="ipyparallel")
    args = c.parse_args(ap, argv)

    sys.path.insert(0, c.REPO)
    from nbdist.session import Session

    s = Session().start(2, engine=args.engine, threads=1, timeout=120)
    speed: dict[str, list[float]] = {k: [] for k in STRATEGIES}
    memory: dict[str, Any] = {}
    on_off: list[float] = []
    try:
        s.run_cell(SETUP, output="quiet")
        s.run_cell("run('ddp', 2, 1)", output="quiet", telemetry=False)  # first-use costs
        for k in range(args.rounds):
            order = STRATEGIES[k % len(STRATEGIES):] + STRATEGIES[:k % len(STRATEGIES)]
            for name in order:
                s.run_cell(f"_bench = run({name!r}, {args.steps}, {args.warmup})",
                           output="quiet", name=name)
                speed[name].append(s.pull("_bench")["samples_per_s"])
            c.log(f"round {k + 1}/{args.rounds}: " + ", ".join(
                f"{n} {speed[n][-1]:.0f}" for n in STRATEGIES))
        for f in s.compare().runs:
            memory[f.name] = f
        for k in range(args.pairs):
            got = {}
            for arm in (("on", "off") if k % 2 == 0 else ("off", "on")):
                s.run_cell(f"_bench = run('fsdp2', {args.steps}, {args.warmup})",
                           output="quiet", telemetry=arm == "on")
                got[arm] = s.pull("_bench")["samples_per_s"]
            on_off.append(got["on"] / got["off"])
            c.log(f"fsdp2 pair {k + 1}/{args.pairs}: on/off {on_off[-1]:.3f}")
    finally:
        s.stop()

    base = statistics.median(speed["ddp"])
    base_mem = memory["ddp"]
    rows = []
    out: dict[str, Any] = {"benchmark": "strategies", "engine": args.engine, "workers": 2,
                           "steps": args.steps, "rounds": args.rounds, "machine": c.machine()}
    for name in STRATEGIES:
        f = memory[name]
        med = statistics.median(speed[name])
        rows.append([name, med, c.ratio(med, base),
                     f"{min(speed[name]) / base:.2f}-{max(speed[name]) / base:.2f}",
                     c.ratio(f.params, base_mem.params), c.ratio(f.optimizer, base_mem.optimizer),
                     (f.bytes_per_step or 0) / 1e6])
        out[name] = {"samples_per_s": med, "vs_ddp": med / base,
                     "params_vs_ddp": f.params / base_mem.params,
                     "optimizer_vs_ddp": f.optimizer / base_mem.optimizer,
                     "comm_mb_per_step": (f.bytes_per_step or 0) / 1e6}
    print(c.table(["strategy", "median samples/s", "vs DDP", "spread", "params/rank vs DDP",
                   "optimizer/rank vs DDP", "comm MB/step"], rows))
    out["fsdp2_telemetry_on_off"] = statistics.median(on_off)
    out["fsdp2_telemetry_on_off_range"] = [min(on_off), max(on_off)]
    print(f"FSDP2 telemetry on/off (median of {args.pairs} pairs): "
          f"{out['fsdp2_telemetry_on_off']:.3f} [{min(on_off):.3f} .. {max(on_off):.3f}], "
          "target >= 0.97")
    print("RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
