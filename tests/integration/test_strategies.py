"""ZeRO-1, FSDP2 and gradient compression in cells, as torch's docs write them, on real
2-rank gloo groups: trained parameters against single-process ground truth, collectives in
the trace with bytes, memory per rank, and the comparison of named runs."""

from __future__ import annotations

import json

import pytest
import torch
from clusters import start_session

pytestmark = pytest.mark.timeout(240)

STEPS = 3
SETUP = f"""
import torch, torch.distributed as dist
import nbdist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.fsdp import fully_shard
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

def make():
    torch.manual_seed(0)  # four equal layers, so ZeRO can split them evenly over 2 ranks
    return torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])

def batch(step, r):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)

def train(model, opt, steps={STEPS}):
    for k in range(steps):
        x, y = batch(k, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()

def full_state(model):
    model = getattr(model, "module", model)  # DDP's wrapped model
    return {{k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}}
"""

CASES = {
    "ddp": "m = DDP(make())\nopt = torch.optim.Adam(m.parameters(), lr=1e-2)",
    "fp16": "m = DDP(make())\nm.register_comm_hook(None, default_hooks.fp16_compress_hook)\n"
            "opt = torch.optim.Adam(m.parameters(), lr=1e-2)",
    "zero1": "m = DDP(make())\nopt = ZeroRedundancyOptimizer(m.parameters(), "
             "optimizer_class=torch.optim.Adam, lr=1e-2)",
    "fsdp2": "m = make()\nfor layer in m:\n    fully_shard(layer, mesh=nbdist.mesh())\n"
             "fully_shard(m, mesh=nbdist.mesh())\nopt = torch.optim.Adam(m.parameters(), lr=1e-2)",
}


def ground_truth() -> dict[str, torch.Tensor]:
    """One process trained on the union of both ranks' batches (what DDP computes)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for k in range(STEPS):
        xs, ys = zip(*(_batch(k, r) for r in (0, 1)))
        loss = torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _batch(step: int, r: int):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every strategy trained once, as a named run; its parameters, snapshot and trace."""
    s = start_session("ipyparallel")
    out = {}
    try:
        s.run_cell(SETUP)
        for name, build in CASES.items():
            s.run_cell(f"{build}\ntrain(m, opt)\nparams = full_state(m)", name=name,
                       output="quiet")
            path = tmp_path_factory.mktemp("traces") / f"{name}.json"
            s.timeline(str(path))
            out[name] = {"params": s.pull("params"), "snap": s.last_run,
                         "trace": json.loads(path.read_text())}
        out["compare"] = s.compare()
        yield out
    finally:
        s.stop()


@pytest.mark.parametrize("name", ["ddp", "zero1", "fsdp2"])
def test_parameters_equal_single_process_training_on_the_union_batch(trained, name):
    want = ground_truth()
    got = trained[name]["params"]
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key].to(want[key].dtype), want[key], rtol=1e-5,
                                   atol=1e-6, msg=f"{name}: {key}")


def comm_by_rank(trace: dict) -> dict[int, list[dict]]:
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "process_name"}
    out: dict[int, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e.get("cat") == "comm":
            out.setdefault(int(names[e["pid"]].split()[-1]), []).append(e)
    return out


def test_fsdp2_trace_has_all_gathers_and_reduce_scatters_on_every_rank(trained):
    by_rank = comm_by_rank(trained["fsdp2"]["trace"])
    assert sorted(by_rank) == [0, 1]
    for events in by_rank.values():
        ops = {e["name"] for e in events}
        assert {"all_gather_single", "reduce_scatter_single"} <= ops
        assert all(e["args"]["bytes"] > 0 for e in events)
        steps = {e["args"]["step"] for e in events if e["name"] == "reduce_scatter_single"}
        assert steps == set(range(STEPS))  # attributed to optimizer steps


def test_zero1_trace_has_its_parameter_broadcasts(trained):
    for events in comm_by_rank(trained["zero1"]["trace"]).values():
        broadcasts = [e for e in events if e["name"] == "broadcast"]
        assert len(broadcasts) >= STEPS and all(e["args"]["bytes"] > 0 for e in broadcasts)


def test_fp16_compression_halves_the_bytes_per_gradient_all_reduce(trained):
    def bucket_bytes(name: str) -> int:
        # each bucket's all-reduce (fp16's hook is timed per bucket), or each step's span
        # from DDP's own timer (plain DDP)
        return sum(e["args"]["bytes"] for e in comm_by_rank(trained[name]["trace"])[0]
                   if e["name"].startswith("bucket") or e["name"].endswith("(all buckets)"))

    assert bucket_bytes("fp16") * 2 == bucket_bytes("ddp")


def memory(trained, name):
    return {r.rank: r.memory for r in trained[name]["snap"].ranks}


def test_sharding_halves_what_each_rank_holds(trained):
    ddp, zero, fsdp = (memory(trained, n) for n in ("ddp", "zero1", "fsdp2"))
    for r in (0, 1):
        assert ddp[r] is not None and ddp[r].optimizer > 0
        assert zero[r].optimizer == pytest.approx(ddp[r].optimizer / 2, rel=0.1)
        assert zero[r].params == ddp[r].params  # ZeRO-1 keeps every parameter
        assert fsdp[r].optimizer == pytest.approx(ddp[r].optimizer / 2, rel=0.1)
        assert fsdp[r].params == pytest.approx(ddp[r].params / 2, rel=0.1)
        assert ddp[r].peak and ddp[r].rss


def test_compare_lists_every_named_run_with_its_figures(trained):
    c = trained["compare"]
    assert [r.name for r in c.runs] == list(CASES)
    for r in c.runs:
        assert r.steps == STEPS and r.bytes_per_step and r.optimizer and r.step_s
    frame = c.to_pandas()
    assert frame.loc["fsdp2", "params/rank (MB)"] < frame.loc["ddp", "params/rank (MB)"]
    assert "fsdp2" in c._repr_html_()
    # without DDP, samples come from the batch FSDP2's root module sees: 8 rows, 2 ranks
    assert (frame["samples/s"] > 0).all()
    assert frame.loc["fsdp2", "samples/s"] == pytest.approx(16 / c.runs[3].step_s, rel=0.5)


@pytest.mark.parametrize("name, psi_divides", [("zero1", "optimizer"), ("fsdp2", "all")])
def test_sharded_memory_is_judged_against_zeros_model(trained, name, psi_divides):
    [v] = [v for v in trained[name]["snap"].verdicts if v.rule == "memory"]
    psi = 4 * (32 * 32 + 32)
    assert v.figure("psi") == psi and v.figure("ranks") == 2
    k = v.figure("state_per_param")  # Adam: two fp32 moments, and a step count per tensor
    assert k == pytest.approx(8, rel=0.01)
    want = k * psi / 2 if psi_divides == "optimizer" else (4 + 4 + k) * psi / 2
    assert v.figure("predicted") == pytest.approx(want)
    # four equal layers split evenly: as predicted, so no reason is given
    assert v.figure("measured") == pytest.approx(want, rel=0.2) and "off:" not in v.text
