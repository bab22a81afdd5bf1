"""Watching jobs started elsewhere (``%nbdist attach``): what it costs the job, and the notebook.

**Overhead.** The same ``torchrun --standalone --nproc_per_node=2`` CPU job (``workload.py``:
the DDP MLP of ``bench_training.py``, batch 64 per rank, 1 torch thread per rank), run
attached (``NBDIST_ATTACH`` set, reporting to a real collector in this process) and
unattached. Each job is started once, builds its model and takes ``--warmup`` steps, then
trains in timed windows of ``--steps`` steps when asked (``workload.py --mode serve``); each of
``--rounds`` rounds runs one window of every job in a fresh random order, so the sides share
the machine's bursts of load. A second unattached job is the noise floor (what two jobs that
do not differ measure). A round's ratio is attached samples/s over unattached; reported: the
median of the rounds' ratios and their spread, and each side's CPU per step (every thread of
the rank process: the agent's included). Target: attached >= 0.98x unattached. The job
reports through the start-up hook as a wheel installs it (``nbdist-attach.pth``, put in a site
directory of its own here, since a checkout is installed in editable mode: torchrun's own
process is the node's forwarder), or with ``--how agent`` as ``torchrun -m nbdist.agent``.

**Fan-in.** ``--ranks`` simulated ranks on ``--hosts`` hosts (one forwarder connection per
host, as the agent keeps) report into a real :class:`~nbdist.watch.collector.Collector` in this
process: each rank's events are ``bench_scale.py``'s synthetic DDP job (``--rate`` steps/s,
``--buckets`` buckets per step, memory, a logged value, one slower rank), packed in batches as a
rank's sink packs them every ``flush_interval(ranks)`` seconds, and sent in the wire's frames by
a child process, each host's frames together every 0.1 s (a forwarder's poll), paced on the
real clock. Timed after ``--warmup`` seconds: the CPU of the collector's threads (reading and
decoding every frame, folding them) and of the job's panel (``%nbdist job ID show``'s widget,
refreshed as its thread does: every second, or every ``flush_interval(ranks)`` seconds
where the ranks report less often, or less often still where a redraw would take more than
2 % of the kernel; its messages serialized to JSON), per second of simulated training, as a
percentage of one core (median of ``--repeats``, with min and max). Target: under 10 % at 1,024
ranks on 128 hosts. The cell path at 16,384 ranks is ``bench_scale.py --worlds 16384``'s.

    python benchmarks/bench_attach.py [--parts overhead fanin] [--rounds 15] [--steps 200]
                                      [--ranks 1024] [--hosts 128] [--seconds 10] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

try:
    from benchmarks import _common as c
    from benchmarks import bench_scale as scale
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import _common as c  # type: ignore[no-redef]
    import bench_scale as scale  # type: ignore[no-redef]

WORKLOAD = os.path.join(c.HERE, "workload.py")
#: attached samples/s over unattached, at least
TARGET_RATIO = 0.98
#: the notebook's CPU for the simulated fan-in, under (% of one core)
TARGET_PERCENT = 10.0
#: seconds between a forwarder's looks at its ranks' spool (what it sends at once)
TICK = 0.1


# ----------------------------------------------------------------- overhead
def site_dir(root: str) -> str:
    """A site directory holding the start-up hook as a wheel installs it, and a
    ``sitecustomize`` that adds it (site-packages' ``.pth`` files run at start-up)."""
    site = os.path.join(root, "site")
    os.makedirs(site)
    shutil.copy(os.path.join(c.REPO, "nbdist-attach.pth"), site)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(f"import site\nsite.addsitedir({site!r})\n")
    return site


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Attached vs unattached torchrun jobs, interleaved windows; figures of every round."""
    from nbdist.watch.collector import Collector

    root = tempfile.mkdtemp(prefix="bench-attach-")
    collector = Collector()
    plain = {k: v for k, v in os.environ.items() if not k.startswith("NBDIST_ATTACH")}
    plain["PYTHONPATH"] = os.pathsep.join([c.HERE, c.REPO])
    attached = dict(plain, NBDIST_ATTACH=collector.address.line)
    launcher = ["--standalone"]
    if args.how == "hook":
        attached["PYTHONPATH"] = os.pathsep.join([site_dir(root), c.HERE, c.REPO])
    else:
        launcher += ["-m", "nbdist.agent"]
    job_args = ["--warmup", str(args.warmup), "--threads", "1"]
    sides = {"unattached": (plain, ["--standalone"]), "attached": (attached, launcher),
             "unattached again": (plain, ["--standalone"])}
    servers: dict[str, c.TorchrunServer] = {}
    rounds: list[dict[str, dict[str, Any]]] = []
    try:
        for name, (env, launch) in sides.items():
            c.log(f"overhead: starting the {name} job")
            servers[name] = c.TorchrunServer(WORKLOAD, job_args, 2, args.timeout, env=env,
                                             launcher_args=launch)
        for i in range(args.rounds):
            order = list(servers)
            random.shuffle(order)
            got = {name: servers[name].window(args.steps) for name in order}
            rounds.append(got)
            sps = {name: got[name]["samples_per_s"] for name in got}
            c.log(f"overhead round {i + 1}/{args.rounds}: attached / unattached "
                  f"{sps['attached'] / sps['unattached']:.3f} (noise floor "
                  f"{sps['unattached again'] / sps['unattached']:.3f})")
    finally:
        for server in servers.values():
            server.close()
        try:  # the attached job's end reaches the notebook after its launcher's exit
            end = time.monotonic() + 30
            while (any(r.state == "running" for r in collector.jobs.records())
                   and time.monotonic() < end):
                time.sleep(0.1)
            records = collector.jobs.records()
        finally:
            collector.close()
            shutil.rmtree(root, ignore_errors=True)
    # The attached job must have been watched: both ranks, every step it trained.
    trained = args.warmup + args.rounds * args.steps
    if (len(records) != 1 or records[0].state != "finished"
            or records[0].steps != {0: trained, 1: trained}):
        raise RuntimeError(f"the attached job was not watched whole ({trained} steps per "
                           f"rank): {[r.line() for r in records]}")
    return {"rounds": rounds, "record": records[0].line(), "trained": trained,
            "seen": records[0].steps, "connections": collector.accepted}


def report_overhead(res: dict[str, Any], args: argparse.Namespace) -> list[str]:
    rounds = res["rounds"]
    ratios = [r["attached"]["samples_per_s"] / r["unattached"]["samples_per_s"] for r in rounds]
    floor = [r["unattached again"]["samples_per_s"] / r["unattached"]["samples_per_s"]
             for r in rounds]
    rows = []
    for side in ("unattached", "attached", "unattached again"):
        sps = [r[side]["samples_per_s"] for r in rounds]
        cpu = [r[side]["cpu_ms_per_step"] for r in rounds]
        rows.append([side, c.median(sps), c.p90(sps), min(sps), max(sps), c.median(cpu)])
    print(c.table(["torchrun job", "samples/s median", "p90", "min", "max",
                   "CPU ms/step (rank, all threads)"], rows))
    print(f"the attached job as the notebook saw it: {res['record']} "
          f"({res['connections']} connection)")
    med = statistics.median(ratios)
    lines = [f"attached / unattached ratio {med:.3f} (median of {len(rounds)} rounds, "
             f"min {min(ratios):.3f}, max {max(ratios):.3f}); noise floor "
             f"{statistics.median(floor):.3f} [{min(floor):.3f}-{max(floor):.3f}]",
             f"target attached >= {TARGET_RATIO:g}x unattached ({args.how}): "
             f"{'met' if med >= TARGET_RATIO else 'missed'}"]
    print("\n".join(lines))
    return lines


# ----------------------------------------------------------------- fan-in
class _Frames:
    """``bench_scale.messages``' transport: a rank's batch becomes the wire's frame."""

    def __init__(self, key: str):
        self.key = key

    def send(self, batch: dict[str, Any]) -> tuple[int, bytes]:
        from nbdist.agent import wire

        return batch["rank"], wire.encode({"type": "batch", "job": self.key, "batch": batch})


def sender(args: argparse.Namespace) -> int:
    """The child process: every host's forwarder connection, paced on the real clock."""
    import socket

    from nbdist.agent import wire

    address = wire.parse(os.environ[wire.ENV])
    per_host = args.ranks // args.hosts
    key = "torchrun-bench-fanin"
    t0 = time.time() + 2.0  # the steps' times: the training starts as the sending does
    job = scale.Submission(args.ranks, args.rate, args.buckets, t0=t0)
    stream = list(scale.messages(job, args.warmup + args.seconds, "tables", TICK,
                                 _Frames(key)))  # type: ignore[arg-type]
    socks = []
    for h in range(args.hosts):
        s = socket.create_connection((address.host, address.port), timeout=30)
        s.sendall(wire.hello(address.token, f"sim-host-{h:03d}", 100_000 + h))
        if not wire.decode(s.recv(4096)[4:]).get("ok"):
            raise RuntimeError("the collector refused the token")
        s.sendall(b"".join(wire.encode({
            "type": "rank", "job": key, "rank": r, "world_size": args.ranks,
            "local_rank": r % per_host, "host": f"sim-host-{h:03d}", "pid": 200_000 + r,
            "restart": 0, "t": time.time()}) for r in range(h * per_host, (h + 1) * per_host)))
        socks.append(s)
    first = round(args.warmup / TICK)
    sent = {"frames": 0, "bytes": 0}
    time.sleep(max(0.0, t0 - time.time()))
    start = time.monotonic()
    for k, frames in enumerate(stream):
        if k == first:
            print(f"WARM {time.monotonic():.6f}", flush=True)
        time.sleep(max(0.0, start + (k + 1) * TICK - time.monotonic()))
        by_host: dict[int, list[bytes]] = {}
        for rank, frame in frames:
            by_host.setdefault(rank // per_host, []).append(frame)
        for h, fs in by_host.items():
            socks[h].sendall(b"".join(fs))
            if k >= first:
                sent["frames"] += len(fs)
                sent["bytes"] += sum(len(f) for f in fs)
    print(f"DONE {time.monotonic():.6f} {json.dumps(sent)}", flush=True)
    sys.stdin.readline()  # the notebook's side has read its threads' CPU: end the job
    for h, s in enumerate(socks):
        s.sendall(b"".join(wire.encode({
            "type": "exit", "job": key, "rank": r, "pid": 200_000 + r, "ok": True,
            "error": None, "lost": False, "t": time.time()})
            for r in range(h * per_host, (h + 1) * per_host)) + wire.encode({"type": "bye"}))
        s.close()
    return 0


def _thread_cpu(prefix: str) -> float:
    """CPU seconds of this process's live threads whose name starts with ``prefix`` (the
    kernel's count, in nanoseconds: ``/proc/self/task/TID/schedstat``)."""
    total = 0
    for t in threading.enumerate():
        if t.name.startswith(prefix) and t.native_id is not None:
            with contextlib.suppress(OSError, ValueError):
                with open(f"/proc/self/task/{t.native_id}/schedstat") as f:
                    total += int(f.read().split()[0])
    return total / 1e9


def _panel(job: Any) -> Any:
    """The widget ``%nbdist job ID show`` draws (``job.show()`` as in a kernel with widgets;
    no frontend displays it: the benchmark refreshes it as its timer would)."""
    import IPython.display

    import nbdist.display

    nbdist.display.widgets_available = lambda: True  # no kernel runs here
    IPython.display.display = lambda *a, **k: None
    panel = job.show()
    # No frontend shows a view of it, so its own thread never starts: the benchmark
    # refreshes it as that thread would (every interval, or longer after a costly redraw).
    return panel


def fanin_once(args: argparse.Namespace) -> dict[str, Any]:
    """One run: the collector and the job's panel here, the hosts in a child process."""
    from nbdist.watch.collector import Collector
    from nbdist.watch.watched import RUNNING, WatchedJob

    comms = scale._json_comms()
    collector = Collector()
    env = dict(os.environ, NBDIST_ATTACH=collector.address.line,
               PYTHONPATH=os.pathsep.join([c.HERE, c.REPO]))
    cmd = [sys.executable, os.path.abspath(__file__), "--child-sender",
           "--ranks", str(args.ranks), "--hosts", str(args.hosts), "--seconds",
           str(args.seconds), "--warmup", str(args.warmup), "--rate", str(args.rate),
           "--buckets", str(args.buckets)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)
    panel = None
    redraw = 0.0
    redraws = 0
    try:
        assert proc.stdout is not None
        marks: dict[str, str] = {}
        lines: list[str] = []
        arrived = threading.Event()

        def read() -> None:
            for ln in proc.stdout:  # type: ignore[union-attr]
                lines.append(ln)
                arrived.set()
            arrived.set()

        # the kernel's main thread is idle while a job is watched: this one waits, too
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        cpu0 = wall0 = redraw0 = None
        folding0 = 0.0
        deadline = time.monotonic() + args.timeout
        next_draw = time.monotonic()
        while "DONE" not in marks:
            if proc.poll() is not None and not reader.is_alive() and not any(
                    ln.startswith("DONE") for ln in lines):
                raise RuntimeError(f"the simulated hosts ended early (exit {proc.returncode})")
            if time.monotonic() > deadline:
                raise c.Deadline("fan-in run past its time limit")
            for ln in lines:
                marks.setdefault(ln.split()[0], ln)
            if "WARM" in marks and cpu0 is None:
                cpu0, wall0, redraw0 = _thread_cpu("nbdist-attach"), time.monotonic(), redraw
                redraws = 0
                folding0 = collector.fold_seconds
                comms["messages"] = comms["bytes"] = 0
            if panel is None and collector.jobs.records():
                panel = _panel(WatchedJob(collector.jobs, collector.jobs.get("1")))
            if panel is not None and time.monotonic() >= next_draw:
                t = time.thread_time()
                panel.refresh()  # what the panel's thread does while shown
                redraw += time.thread_time() - t
                next_draw += panel._delay()  # its interval, or more for a costly redraw
                redraws += 1
            arrived.wait(max(0.0, next_draw - time.monotonic()) if panel is not None else 0.05)
            arrived.clear()
        cpu1, wall1 = _thread_cpu("nbdist-attach"), time.monotonic()
        folding = collector.fold_seconds - folding0
        sent = json.loads(marks["DONE"].split(" ", 2)[2])
        assert proc.stdin is not None
        proc.stdin.write("end\n")
        proc.stdin.close()
        if proc.wait(timeout=60) != 0:
            raise RuntimeError(f"the simulated hosts failed (exit {proc.returncode})")
        end = time.monotonic() + 30
        while collector.jobs.records()[0].state == RUNNING and time.monotonic() < end:
            time.sleep(0.05)
        (rec,) = collector.jobs.records()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        collector.close()
    if cpu0 is None or wall0 is None or redraw0 is None:
        raise RuntimeError("the simulated hosts never warmed up")
    seen = len([n for n in rec.steps.values() if n > 0])
    if (rec.state != "finished" or len(rec.hosts) != args.hosts or seen != args.ranks
            or collector.accepted != args.hosts):
        raise RuntimeError(f"the collector did not see the whole job: {rec.line()[:300]}, "
                           f"{collector.accepted} connections")
    fold, draw = cpu1 - cpu0, redraw - redraw0

    def share(x: float) -> float:
        return 100 * x / args.seconds

    return {"cpu_percent": share(fold + draw), "fold_percent": share(fold),
            "reading_percent": share(fold - folding), "folding_percent": share(folding),
            "redraws_per_s": redraws / args.seconds,
            "panel_percent": share(draw), "wall_s": wall1 - wall0,
            "frames_per_s": sent["frames"] / args.seconds,
            "kib_per_s": sent["bytes"] / 1024 / args.seconds,
            "widget_kib_per_s": comms["bytes"] / 1024 / args.seconds,
            "min_steps": min(rec.steps.values()), "max_steps": max(rec.steps.values())}


def report_fanin(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    cpu = [r["cpu_percent"] for r in runs]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    print(c.table(["ranks / hosts", "CPU % of a core", "min-max", "collector %",
                   "of it reading %", "of it folding %", "panel %", "redraws/s",
                   "frames/s", "KiB/s in", "panel KiB/s", "wall s / simulated s"],
                  [[f"{args.ranks} / {args.hosts}", med("cpu_percent"),
                    f"{min(cpu):.1f}-{max(cpu):.1f}", med("fold_percent"),
                    med("reading_percent"), med("folding_percent"),
                    med("panel_percent"), med("redraws_per_s"), round(med("frames_per_s")),
                    round(med("kib_per_s")),
                    med("widget_kib_per_s"), f"{med('wall_s'):.1f} / {args.seconds:g}"]]))
    print("CPU % of a core: the kernel's CPU seconds per second of simulated training, median "
          f"of {len(runs)} runs; collector: its thread reading and decoding every connection's "
          "frames and folding them; panel: the job's widget, refreshed as its "
          "thread does")
    worst = statistics.median(cpu)
    line = (f"target fan-in, {args.ranks} ranks on {args.hosts} hosts: under "
            f"{TARGET_PERCENT:g} % of one core; measured {worst:.1f} %: "
            f"{'met' if worst < TARGET_PERCENT else 'missed'}")
    print(line)
    return [line]


# ----------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", choices=("overhead", "fanin"),
                    default=["overhead", "fanin"])
    ap.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    ap.add_argument("--how", choices=("hook", "agent"), default="hook",
                    help="how the attached job reports: the start-up hook (torchrun's process "
                         "forwards) or torchrun -m nbdist.agent (a rank forwards)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=200, help="steps per timed window")
    ap.add_argument("--warmup", type=float, default=None,
                    help="overhead: untimed steps (default 20); fan-in: untimed seconds, "
                         "longer than a rank's flush interval (default 5)")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--hosts", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=10.0, help="fan-in: timed seconds")
    ap.add_argument("--repeats", type=int, default=3, help="fan-in runs")
    ap.add_argument("--rate", type=float, default=10.0, help="steps per second per rank")
    ap.add_argument("--buckets", type=int, default=4, help="gradient buckets per step")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--engine", action="append", default=[],
                    help="accepted for run_all.sh: the jobs are torchrun's, no engine runs")
    ap.add_argument("--child-sender", action="store_true", help=argparse.SUPPRESS)
    args = c.parse_args(ap, argv)
    if args.ranks % args.hosts:
        ap.error("--ranks must be a multiple of --hosts")
    if args.child_sender:
        return sender(args)
    if args.quick:
        args.rounds, args.steps, args.repeats, args.seconds = 2, 30, 1, 2.0
    summary: list[str] = []
    result: dict[str, Any] = {"benchmark": "attach", "how": args.how}
    print(f"machine: {c.machine()}")
    with c.deadline(args.timeout):
        try:
            if "overhead" in args.parts:
                fan_warmup = args.warmup
                args.warmup = int(args.warmup if args.warmup is not None else 20)
                res = overhead(args)
                summary += report_overhead(res, args)
                result["overhead"] = res
                args.warmup = fan_warmup
            if "fanin" in args.parts:
                from nbdist.telemetry.events import flush_interval

                if args.warmup is None:
                    args.warmup = max(5.0, flush_interval(args.ranks) + 1.0)
                runs = []
                for i in range(args.repeats):
                    runs.append(fanin_once(args))
                    c.log(f"fan-in run {i + 1}/{args.repeats}: "
                          f"{runs[-1]['cpu_percent']:.1f} % of a core")
                summary += report_fanin(runs, args)
                result["fanin"] = runs
        finally:
            c.kill_children()
    result["machine"] = c.machine()
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
