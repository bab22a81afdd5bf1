"""A watched job's panel in a real Jupyter kernel follows the job while another cell runs:
its widget messages reach the front end's channel before that cell ends."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

SETUP = textwrap.dedent(f"""
    import sys, threading, time
    sys.path.insert(0, {str(REPO / "tests" / "unit")!r})
    from IPython.display import display
    from synthetic import batches, training_events
    from nbdist.display.widgets import JobPanel
    from nbdist.watch.watched import RUNNING, Jobs, WatchedJob
    jobs = Jobs()
    for rank in (0, 1):
        jobs.fold({{"type": "rank", "job": "j", "rank": rank, "world_size": 2, "host": "n1",
                   "pid": 10 + rank}}, 1)
    job = WatchedJob(jobs, jobs.get("1"))
    panel = JobPanel(lambda: job.record.line(), job.snapshot,
                     lambda: job.record.state != RUNNING, [0, 1], interval=0.1)
    display(panel)
    panel._view_count = 1  # what the front end reports once it drew the panel
    print(panel.head.model_id)
""")

# The collector's threads fold the job's frames while this cell holds the kernel.
BUSY = textwrap.dedent("""
    def frames():
        t0 = time.time() - 1
        for rank in (0, 1):
            for b in batches(rank, training_events(6, t0=t0)):
                jobs.fold({"type": "batch", "job": "j", "batch": b}, 1)
    threading.Thread(target=frames).start()
    end = time.monotonic() + 60
    while "steps {0: 6, 1: 6}" not in panel.head.value and time.monotonic() < end:
        time.sleep(0.05)
    print("cell done")  # after the panel's message: both go out on the kernel's one channel
""")


@pytest.mark.timeout(180)
def test_the_panel_updates_while_another_cell_runs():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(REPO))
    try:
        out: list[str] = []
        reply = kc.execute_interactive(
            SETUP, timeout=120,
            output_hook=lambda m: out.append(m["content"].get("text", "")))
        assert reply["content"]["status"] == "ok", reply["content"]
        head = "".join(out).split()[-1]
        msg_id = kc.execute(BUSY)
        seen = []  # (what, text) in the order the front end would get them
        end = time.monotonic() + 120
        while time.monotonic() < end:
            m = kc.get_iopub_msg(timeout=60)
            if m["parent_header"].get("msg_id") != msg_id and m["msg_type"] != "comm_msg":
                continue
            c = m["content"]
            if m["msg_type"] == "comm_msg" and c.get("comm_id") == head:
                seen.append(("head", c["data"].get("state", {}).get("value", "")))
            elif m["msg_type"] == "stream":
                seen.append(("stream", c["text"]))
            elif m["msg_type"] == "status" and c["execution_state"] == "idle":
                break
        done = next(i for i, (what, text) in enumerate(seen) if "cell done" in text)
        moved = [i for i, (what, text) in enumerate(seen)
                 if what == "head" and "steps {0: 6, 1: 6}" in text]
        assert moved and moved[0] < done, seen
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
