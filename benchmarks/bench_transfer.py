"""Push and pull of a large tensor: nbdist vs ipyparallel's own, vs raw loopback TCP.

On 2 workers that are already running, in one process, interleaved:

* **pull**: a ``--mb`` MiB float32 tensor from rank 1 into the notebook: ``nbdist.pull``
  (the rank's shared copy mapped; and with the shared copy off, over the data channel);
  ipyparallel's own ``client[1].pull`` of the same tensor on the same engines (ipyparallel
  pickles a tensor inside its message), and of the same memory as a numpy array (the type
  ipyparallel sends as a buffer of its own); raw TCP: one helper process ``sendall``\\ s the
  same number of bytes to this one, which ``recv_into``\\ s a buffer;
* **push to every rank**: the same size from the notebook to both ranks: ``nbdist.push``
  (workers on this machine map one shared copy; timed again with a cell that then reads
  every byte on each rank, and with the shared copy off, each rank fetching its own over
  the data channel as a rank on another machine does);
  ``client[:].push`` of the tensor and of the numpy array; raw TCP: this process sends the
  bytes to each of two helper processes in turn, which receive them into a buffer they
  touched before the timing, and (a row of its own) into new memory each time, mapped as
  nbdist maps a large arriving buffer: what delivering a new value costs the receiver.

Throughput is bytes delivered (pull: the tensor; push: the tensor times the ranks) per
second of wall time, from the call until the value is in place. Each round runs every
variant once in a fresh random order; reported are the median, min and max over
``--repeats`` rounds, and each variant's ratio to raw TCP of the same pattern (target: nbdist
at least 0.5x). ``--engine dask`` times nbdist on Dask workers too (against the same raw TCP).
``--tls`` adds the data channel rows on a Dask cluster reached over ``tls://`` (a throwaway
certificate authority, ``Security.temporary()``), where the channel speaks TLS too: the
cost of encrypting what workers on other machines get.

    python benchmarks/bench_transfer.py [--mb 256] [--repeats 5] [--engine dask] [--tls]
"""

from __future__ import annotations

import argparse
import random
import socket
import subprocess
import sys
import time
from typing import Any, Callable

try:
    from benchmarks import _common as c
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import _common as c  # type: ignore[no-redef]

# A helper process for raw TCP: listens on loopback, prints its port, then serves commands
# of 32 bytes, "send N" (it sends N bytes) and "recv N" (it receives N bytes, then answers
# one byte). Fixed-size commands: a buffered line reader would take bytes of the data.
HELPER = r"""
import mmap, socket, sys
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept(); srv.close()
buf = bytearray(int(sys.argv[1]))
view = memoryview(buf)
def exactly(n, into):
    got = 0
    while got < n:
        k = conn.recv_into(into[got:n])
        if not k:
            sys.exit(0)
        got += k
cmd = bytearray(32)
while True:
    exactly(32, memoryview(cmd))
    op, n = bytes(cmd).split(); n = int(n)
    if op == b"send":
        conn.sendall(view[:n])
    elif op == b"fresh":  # into new memory, mapped as nbdist maps a large arriving buffer
        new = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        new.madvise(mmap.MADV_HUGEPAGE)
        mv = memoryview(new)
        exactly(n, mv)
        mv.release(); new.close()
        conn.sendall(b"k")
    else:
        exactly(n, view)
        conn.sendall(b"k")
"""


def _cmd(op: str, n: int) -> bytes:
    return f"{op} {n}".encode().ljust(32)


class Helper:
    """One raw-TCP peer process."""

    def __init__(self, nbytes: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HELPER, str(nbytes)],
                                     stdout=subprocess.PIPE, text=True)
        port = int(self.proc.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(10)


def raw_pull(helper: Helper, buf: memoryview) -> None:
    n = len(buf)
    helper.sock.sendall(_cmd("send", n))
    got = 0
    while got < n:
        got += helper.sock.recv_into(buf[got:])


def raw_push(helpers: list[Helper], data: memoryview, op: str = "recv") -> None:
    """To each helper in turn; ``op`` "fresh": each receives into new memory, as a pushed
    value must be (the plain variant reuses one buffer it touched before the timing)."""
    for h in helpers:
        h.sock.sendall(_cmd(op, len(data)))
        h.sock.sendall(data)
        assert h.sock.recv(1) == b"k"


def measure(variants: dict[str, Callable[[], Any]], repeats: int, seed: int,
            after: Callable[[str], None]) -> dict[str, list[float]]:
    names = list(variants)
    for n in names:  # warm-up: each path once, untimed
        variants[n]()
        after(n)
    times: dict[str, list[float]] = {n: [] for n in names}
    rng = random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(names)
        for n in names:
            t0 = time.perf_counter()
            variants[n]()
            times[n].append(time.perf_counter() - t0)
            after(n)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="tensor size in MiB (256)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (5)")
    ap.add_argument("--engine", choices=("ipyparallel", "dask"), action="append",
                    default=None, help="also time nbdist on Dask workers ('dask')")
    ap.add_argument("--tls", action="store_true",
                    help="also the data channel rows on a Dask cluster over tls://")
    ap.add_argument("--timeout", type=float, default=1200, help="overall limit, s (1200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="3 timed rounds")
    args = c.parse_args(ap, argv)
    if args.quick:
        args.repeats = 3
    with c.deadline(args.timeout):
        return _run(args, set(args.engine or ["ipyparallel"]))


def _run(args: argparse.Namespace, engines: set[str]) -> int:
    import torch

    from nbdist.session import Session

    n = 2
    nbytes = args.mb * 2**20
    numel = nbytes // 4
    make = f"import torch\nx = torch.arange({numel}, dtype=torch.float32)\nx_np = x.numpy()"
    payload = torch.arange(numel, dtype=torch.float32)
    payload_np = payload.numpy()
    sessions: dict[str, Session] = {}
    helpers: list[Helper] = []
    tls_cluster = None
    try:
        for engine in ["ipyparallel", *sorted(engines - {"ipyparallel"})]:
            c.log(f"starting nbdist on {n} {engine} workers")
            s = sessions[engine] = Session().start(n, engine=engine, timeout=300)
            s.run_cell(make, output="quiet")
        if args.tls:
            c.log(f"starting a Dask cluster of {n} workers over tls:// and connecting")
            tls_cluster, s = _tls_session(n)
            sessions["dask over TLS"] = s
            s.run_cell(make, output="quiet")
        helpers = [Helper(nbytes) for _ in range(n)]
        sink = memoryview(bytearray(nbytes))
        ipp = sessions["ipyparallel"]
        rc = ipp.backend.client
        one, every = rc[ipp.plans[1].worker_id], rc[[p.worker_id for p in ipp.plans]]
        one.execute(make, block=True)  # ipyparallel's own namespace: its pull reads there

        def checked(got: Any) -> None:
            assert got.shape == payload.shape, got.shape

        def streamed(s: Session, transfer: Callable[[], Any]) -> None:
            """``transfer`` over the data channel's streams, as with a rank on another
            machine (the shared copy switched off)."""
            s.transfers.shared = False
            try:
                transfer()
            finally:
                s.transfers.shared = True

        def push_and_read(s: Session) -> None:
            """The push, then a cell that reads every byte on each rank: a shared copy's
            pages are mapped as a rank first touches them."""
            s.push({"y": payload})
            s.run_cell("y.sum()", output="quiet")

        variants: dict[str, Callable[[], Any]] = {
            "pull: nbdist": lambda: checked(ipp.pull("x", rank=1)),
            "pull: nbdist, data channel": lambda: streamed(ipp, lambda: checked(
                ipp.pull("x", rank=1))),
            "pull: ipyparallel, tensor": lambda: checked(one.pull("x", block=True)),
            "pull: ipyparallel, numpy": lambda: checked(one.pull("x_np", block=True)),
            "pull: raw TCP": lambda: raw_pull(helpers[0], sink),
            "push: nbdist": lambda: ipp.push({"y": payload}),
            "push: nbdist, then every rank reads it": lambda: push_and_read(ipp),
            "push: nbdist, data channel": lambda: streamed(ipp, lambda: ipp.push({"y": payload})),
            "push: ipyparallel, tensor": lambda: every.push({"y": payload}, block=True),
            "push: ipyparallel, numpy": lambda: every.push({"y": payload_np}, block=True),
            "push: raw TCP": lambda: raw_push(helpers, memoryview(payload_np).cast("B")),
            "push: raw TCP, into fresh memory":
                lambda: raw_push(helpers, memoryview(payload_np).cast("B"), "fresh"),
        }
        if "dask" in sessions:
            d = sessions["dask"]
            variants["pull: nbdist, dask"] = lambda: checked(d.pull("x", rank=1))
            variants["pull: nbdist, dask, data channel"] = lambda: streamed(
                d, lambda: checked(d.pull("x", rank=1)))
            variants["push: nbdist, dask"] = lambda: d.push({"y": payload})
            variants["push: nbdist, dask, data channel"] = lambda: streamed(
                d, lambda: d.push({"y": payload}))

        if "dask over TLS" in sessions:
            t = sessions["dask over TLS"]
            variants["pull: nbdist, dask over TLS, data channel"] = lambda: streamed(
                t, lambda: checked(t.pull("x", rank=1)))
            variants["push: nbdist, dask over TLS, data channel"] = lambda: streamed(
                t, lambda: t.push({"y": payload}))

        def after(name: str) -> None:
            if name.startswith("push: nbdist, dask over TLS"):
                sessions["dask over TLS"].run_cell("del y", output="quiet")
            elif name.startswith("push: nbdist, dask"):
                sessions["dask"].run_cell("del y", output="quiet")
            elif name.startswith("push: nbdist"):
                ipp.run_cell("del y", output="quiet")  # the memory goes before the next
            elif name.startswith("push: ipy"):
                every.execute("del y", block=True)

        c.log(f"timing {len(variants)} variants x {args.repeats} rounds of {args.mb} MiB")
        times = measure(variants, args.repeats, args.seed, after)
        if "dask over TLS" in sessions:  # what the TLS rows' connections really were
            t = sessions["dask over TLS"]
            served = dict(t.transfers.channel(t.membership).served)
            c.log(f"the TLS cluster's data channel served: {served}")
            assert set(served) <= {"TLSv1.2", "TLSv1.3"}, served
    finally:
        for h in helpers:
            h.close()
        for s in sessions.values():
            s.stop()
        if tls_cluster is not None:
            tls_cluster.close()

    def gbs(name: str, t: float) -> float:
        delivered = nbytes * (n if name.startswith("push") else 1)
        return delivered / t / 1e9

    rows = []
    for name, ts in times.items():
        rows.append((name, c.median(ts) * 1e3, min(ts) * 1e3, max(ts) * 1e3,
                     gbs(name, c.median(ts)), gbs(name, max(ts)), gbs(name, min(ts))))
    print(f"\n{args.mb} MiB float32 tensor, {n} workers, {args.repeats} interleaved rounds "
          f"({c.machine()})\n")
    print(c.table(["variant", "median ms", "min ms", "max ms", "GB/s (median)", "GB/s min",
                   "GB/s max"], rows))
    print()
    for kind in ("pull", "push"):
        raw = gbs(kind, c.median(times[f"{kind}: raw TCP"]))
        for name in times:
            if name.startswith(kind) and not name.endswith("raw TCP"):
                r = gbs(name, c.median(times[name])) / raw
                print(f"transfer ratio {name} / raw TCP: {r:.2f}x"
                      + (" (target >= 0.5x)" if "nbdist" in name else ""))
    fresh = gbs("push", c.median(times["push: raw TCP, into fresh memory"]))
    for name in (k for k in times if k.startswith("push: nbdist")):
        print(f"transfer ratio {name} / raw TCP into fresh memory: "
              f"{gbs(name, c.median(times[name])) / fresh:.2f}x")
    if "dask over TLS" in sessions:
        for kind in ("pull", "push"):
            plain = gbs(kind, c.median(times[f"{kind}: nbdist, data channel"]))
            tls = gbs(kind, c.median(times[f"{kind}: nbdist, dask over TLS, data channel"]))
            print(f"transfer ratio {kind}: nbdist, dask over TLS, data channel / "
                  f"{kind}: nbdist, data channel (plain TCP): {tls / plain:.2f}x")
    return 0


def _tls_session(n: int) -> tuple[Any, Any]:
    """A Dask cluster of ``n`` workers on loopback over ``tls://``, and a session connected
    to it (the data channel then speaks TLS)."""
    import logging

    import distributed
    from distributed.security import Security

    from nbdist.session import Session

    sec = Security.temporary()
    cluster = distributed.LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                       protocol="tls://", host="127.0.0.1", security=sec,
                                       dashboard_address="127.0.0.1:0", memory_limit=0,
                                       silence_logs=logging.WARNING)
    try:
        s = Session().connect(engine="dask", address=cluster.scheduler_address,
                              security=sec, timeout=300)
    except BaseException:
        cluster.close()
        raise
    return cluster, s


if __name__ == "__main__":
    sys.exit(main())
