"""A ``%nbdist run`` script reports as a cell's rank does (:class:`nbdist.runtime.script.Relay`):
its process's rank agent writes its batches to the worker's spool directory, and the worker
hands their events to its own sink as the rank's; the script's own end is left out, the
worker's (from the exit status) is the rank's last event."""

from __future__ import annotations

import os
import socket
import time

import pytest

from nbdist.agent import wire
from nbdist.agent.spool import SpoolWriter
from nbdist.runtime.capture import EventSink
from nbdist.runtime.script import Relay, run
from nbdist.telemetry import events as ev
from nbdist.telemetry.aggregate import RunState
from nbdist.telemetry.columns import pack, unpack
from nbdist.telemetry.states import RankState

pytestmark = pytest.mark.timeout(60)

STEPS = 6

# One rank of a DDP job, with a bar of nbdist's, a tqdm loop and a logged value.
DDP_SCRIPT = f"""
import torch, torch.distributed as dist
from tqdm import tqdm
import nbdist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in nbdist.progress(range({STEPS}), desc="epoch"):
    loss = model(torch.ones(8, 4)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    nbdist.log(loss=float(loss))
for _ in tqdm(range(3), desc="eval"):
    pass
dist.destroy_process_group()
"""


def _events(sent: list[dict]) -> list[dict]:
    return [e for b in sent for e in unpack(b["events"])]


def test_the_relay_hands_the_scripts_batches_to_the_sink_without_its_end(tmp_path):
    sent: list[dict] = []
    sink = EventSink(1, sent.append, interval=3600)
    relay = Relay(sink)
    writer = SpoolWriter(relay.directory, pid=4242)
    t = time.time()
    batch = {"rank": 1, "seq": 1, "events": pack([
        ev.progress(1, "epoch", 2, 5, t, False), ev.scalars({"loss": 0.5}, t, 2),
        ev.end(True, t)])}
    for msg in ({"type": "rank", "job": "j", "rank": 1, "t": t},
                {"type": "batch", "job": "j", "batch": batch},
                {"type": "exit", "job": "j", "rank": 1, "ok": True, "t": t}):
        writer.write(wire.encode(msg))
    writer.close()
    try:
        assert relay.pump() == 2
        assert relay.pump() == 0  # each frame once
    finally:
        relay.close()
        sink.close()
    kinds = [e["kind"] for e in _events(sent)]
    assert kinds == [ev.PROGRESS, ev.SCALARS]
    assert all(b["rank"] == 1 for b in sent)


def test_the_relay_removes_its_directory():
    sink = EventSink(0, None)
    relay = Relay(sink).start()
    assert os.path.isdir(relay.directory)
    relay.close()
    sink.close()
    assert not os.path.exists(relay.directory)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_ddp_scripts_steps_bars_and_values_reach_the_run_record(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT)
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    sent: list[dict] = []
    sink = EventSink(0, sent.append, interval=3600)
    try:
        result = run(str(script), DDP_SCRIPT, [], env, str(tmp_path), sink)
    finally:
        sink.close()
    assert result["ok"], result
    assert _events(sent)[-1]["kind"] == ev.END  # the worker's end, the rank's last event
    assert [e["kind"] for e in _events(sent)].count(ev.END) == 1
    state = RunState([0])
    state.feed(sent)
    state.finish()
    snap = state.snapshot()
    assert snap.steps == STEPS  # DDP steps, measured as in a cell
    assert len(snap.scalar_series["loss"][0]) == STEPS
    row = snap.ranks[0]
    assert row.state == RankState.DONE
    assert row.bar is not None and row.bar.done
