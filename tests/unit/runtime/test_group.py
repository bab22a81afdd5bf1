"""The default process group formed again under the same generation, on real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]

RANK = '''
import os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from nbdist.runtime import group
rank, port_file = int(sys.argv[1]), sys.argv[2]
if rank == 0:
    port = group.open_store("127.0.0.1", "test", 30)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(port))
    os.rename(port_file + ".tmp", port_file)
else:
    while not os.path.exists(port_file):
        time.sleep(0.01)
    port = int(open(port_file).read())
group.form(1, rank, 2, "gloo", "127.0.0.1", port, 10, None)
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()  # as the user's code (or a library's end_training()) does
store = group.client("127.0.0.1", port, 30)
if rank == 0:
    # rank 1 reads the group's addresses first: without a fresh prefix it reads rank 0's old one
    store.wait(["rank1-forming"])
    time.sleep(1.0)
else:
    store.set("rank1-forming", "1")
group.form(1, rank, 2, "gloo", "127.0.0.1", port, 10, None)
t = torch.ones(1)
dist.all_reduce(t)
print("sum", t.item(), flush=True)
if rank == 0:
    store.wait(["done1"])  # rank 0 hosts the store: it stays until rank 1 needs it no more
else:
    try:
        store.set("done1", "1")
    except Exception:  # rank 0 may already be gone with the store: this rank is done
        pass
os._exit(0)
'''


def test_a_group_destroyed_in_a_cell_forms_again_under_its_generation(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(root=str(ROOT)))
    port_file = str(tmp_path / "port")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port_file],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and "sum 2.0" in out, f"rank {r}:\n{out}"


KEEP = '''
import sys
import torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from nbdist.runtime import group
group.install_guard()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
pg = dist.distributed_c10d._get_default_group()
dist.barrier()
dist.destroy_process_group()  # as a library's end_training() does in a cell
assert not dist.is_initialized()
assert group._destroyed == [pg], group._destroyed  # alive until the next cell begins
group.release_destroyed()
assert group._destroyed == []
print("ok")
'''


def test_a_group_a_cell_destroys_is_freed_only_as_the_next_cell_begins(tmp_path):
    """torch joins a gloo group's threads in its destructor holding the GIL, while a thread
    letting go of a collective's tensors needs it: freed at once after a barrier, a rank can
    hang for good. The guard keeps the group until the next cell."""
    script = tmp_path / "keep.py"
    script.write_text(KEEP.format(root=str(ROOT)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
