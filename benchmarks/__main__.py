"""Run the benchmarks one after another and repeat their ratio lines at the end.

    python -m benchmarks [--quick] [--engine dask] [--only NAME] [--log FILE] [--check]

Each benchmark runs in its own process (its own IPython shell and clusters); any failure is
reported and the others still run. The exit status is non-zero if any benchmark failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# name, script, full arguments, --quick arguments (a smoke run of a few minutes in all)
BENCHMARKS = [
    ("dispatch", "bench_dispatch.py", [], ["--repeats", "30", "--warmup", "5"]),
    ("training", "bench_training.py", [], ["--steps", "50", "--warmup", "5", "--repeats", "1"]),
    ("startup", "bench_startup.py", [], ["--repeats", "1", "--no-prime", "--heals", "1"]),
    ("transfer", "bench_transfer.py", [], ["--quick"]),
    ("strategies", "bench_strategies.py", [], ["--steps", "20", "--rounds", "1", "--pairs", "1"]),
    ("parallelism", "bench_parallelism.py", [],
     ["--steps", "20", "--rounds", "1", "--seconds", "1"]),
    ("scale", "bench_scale.py", [],
     ["--worlds", "64", "256", "--seconds", "2", "--warmup", "1", "--repeats", "1"]),
    ("elastic", "bench_elastic.py", [],
     ["--steps", "50", "--warmup", "5", "--rounds", "1", "--recoveries", "1"]),
    ("tune", "bench_tune.py", [], ["--steps", "20", "--rounds", "2", "--tune-steps", "8"]),
    ("soak", "bench_soak.py", [], ["--cells", "150", "--warmup", "40", "--window", "5"]),
    ("attach", "bench_attach.py", [], ["--quick"]),
]


def describe_run(argv: list[str]) -> str:
    """Date, commit, interpreter, torch and load: the context the figures were taken in."""
    import platform

    import torch

    def out(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=HERE).stdout.strip()
        except OSError:
            return "?"

    dirty = " (with uncommitted changes)" if out("git", "status", "--porcelain") else ""
    return (f"date: {out('date', '-u')}\n"
            f"commit: {out('git', 'rev-parse', '--short', 'HEAD')}{dirty}\n"
            f"machine: {os.cpu_count()} cores, {platform.machine()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}\n"
            f"load before: {out('uptime')}\n"
            f"command: python -m benchmarks {' '.join(argv)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    ap.add_argument("--engine", choices=("ipyparallel", "dask"), default=None,
                    help="also time nbdist on this engine where a benchmark supports it")
    ap.add_argument("--only", choices=[b[0] for b in BENCHMARKS], action="append",
                    help="run only this benchmark (repeatable)")
    ap.add_argument("--log", default=None, metavar="FILE",
                    help="also write every benchmark's standard output to FILE")
    ap.add_argument("--check", action="store_true",
                    help="check each benchmark's command line as it would run, and exit: "
                         "nothing is started")
    args = ap.parse_args(argv)
    summary: list[str] = []
    failed = []
    log = open(args.log, "w", encoding="utf-8") if args.log else None
    # the run's context imports torch: not needed to check the command lines
    head = ("checking each benchmark's command line" if args.check
            else describe_run(sys.argv[1:] if argv is None else argv))
    print(head, flush=True)
    if log is not None:
        log.write(head + "\n")
    try:
        for name, script, full, quick in BENCHMARKS:
            if args.only and name not in args.only:
                continue
            cmd = [sys.executable, os.path.join(HERE, script), *(quick if args.quick else full)]
            if args.engine == "dask":
                cmd += ["--engine", "ipyparallel", "--engine", "dask"]
            elif name in ("startup", "training", "soak"):  # alone, they time both engines
                cmd += ["--engine", "ipyparallel"]
            if args.check:
                cmd.append("--check")
            header = f"\n=== {name}: {' '.join(cmd[1:])}"
            print(header, flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            print(proc.stdout, end="", flush=True)
            if log is not None:
                log.write(header + "\n" + proc.stdout)
                log.flush()
            if proc.returncode != 0:
                failed.append(name)
                summary.append(f"{name}: FAILED (exit {proc.returncode})")
                continue
            summary += [f"{name}: {line}" for line in proc.stdout.splitlines()
                        if " ratio " in line or line.startswith("target")]
            summary.append(f"{name}: took {time.perf_counter() - t0:.0f} s")
    finally:
        if log is not None:
            log.close()
    print("\n=== summary")
    print("\n".join(summary))
    print(f"load after: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} "
          f"{os.getloadavg()[2]:.2f} (1, 5, 15 min)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
