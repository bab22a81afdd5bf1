"""Integration: telemetry from real 2-worker DDP training cells, for every engine."""

from __future__ import annotations

import json
import textwrap

import pytest

from nbdist.errors import DistributedError

pytestmark = pytest.mark.timeout(240)

TRAIN = """
    import torch, nbdist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    ddp = DDP(net, bucket_cap_mb=0.02)   # ~20 kB buckets: several per step
    {hook}
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for x in nbdist.progress([torch.randn(16, 32) for _ in range({steps})], desc="train"):
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        nbdist.log(loss=loss)
    final = [p.detach().clone() for p in net.parameters()]
"""


def train(session, steps=6, hook="", **kw):
    kw.setdefault("output", "quiet")
    code = textwrap.dedent(TRAIN).format(hook=hook, steps=steps)
    session.run_cell(code, **kw)
    return session.runs[-1].events() if kw.get("telemetry", True) else None


def kinds(evs, kind):
    return [e for e in evs if e["kind"] == kind]


def check_buckets(evs, steps, grad_bytes, bytes_factor=1.0, dtype="float32"):
    step_events = kinds(evs, "step")
    assert [e["step"] for e in step_events] == list(range(steps))
    buckets = [e for e in kinds(evs, "comm") if e["bucket"] is not None]
    for n in range(steps):
        mine = [b for b in buckets if b["step"] == n]
        indices = [b["bucket"] for b in mine]
        assert sorted(indices) == list(range(len(mine))), indices
        # DDP buckets the first step by its own first-bucket size, then rebuilds the buckets
        assert len(mine) >= (2 if n else 1), indices
        assert sum(b["bytes"] for b in mine) == grad_bytes * bytes_factor
        assert all(b["dtype"] == dtype and b["measured"] == "wire" for b in mine)
        assert all(b["t1"] > b["t0"] for b in mine), "every bucket is timed"
        st = step_events[n]
        assert st["buckets"] == len(mine) and st["comm_bytes"] == sum(b["bytes"] for b in mine)
        assert st["samples"] == 16 and st["t1"] > st["t0"] and st["source"] == "ddp"
        assert 0 <= st["comm_exposed_s"] <= st["t1"] - st["t0"]
        assert st["fwd"][0] <= st["fwd"][1] <= st["bwd"][0] <= st["bwd"][1]


def test_ddp_steps_and_one_allreduce_per_bucket_summing_to_gradient_size(cluster):
    evs_by_rank = train(cluster, bucket_timing=True)
    grad_bytes = cluster.pull("grad_bytes")
    assert set(evs_by_rank) == {0, 1}
    for evs in evs_by_rank.values():
        check_buckets(evs, 6, grad_bytes)
        assert kinds(evs, "scalars")[-1]["values"]["loss"] > 0
        bars = kinds(evs, "progress")
        assert bars[-1]["n"] == 6 and bars[-1]["total"] == 6 and bars[-1]["done"]
    snap = cluster.last_run
    assert [r.state for r in snap.ranks] == ["done", "done"]
    assert all(r.steps == 6 and r.steps_per_s and r.bandwidth for r in snap.ranks)
    assert len(snap.series) == 6 and "loss" in snap.scalars


def test_by_default_ddps_own_timer_gives_each_step_one_all_reduce_span(cluster):
    evs_by_rank = train(cluster, steps=5)
    grad_bytes = cluster.pull("grad_bytes")
    # DDP's own count of its buckets after it rebuilt them (ground truth for the step's count)
    cluster.run_cell("info = ddp._get_ddp_logging_data()", output="quiet")
    n_buckets = len(cluster.pull("info")["rebuilt_bucket_sizes"].split(","))
    assert n_buckets >= 2
    for evs in evs_by_rank.values():
        steps = kinds(evs, "step")
        assert [e["step"] for e in steps] == list(range(5))
        spans = kinds(evs, "comm")
        assert [c["step"] for c in spans] == list(range(5)), "one span per step"
        for st, c in zip(steps, spans):
            assert c["op"] == "all_reduce" and c["measured"] == "ddp" and c["bucket"] is None
            assert c["bytes"] == st["comm_bytes"] == grad_bytes and c["dtype"] == "float"
            # the span lies inside the step's backward, which starts after its forward
            assert st["t0"] <= st["fwd"][0] <= st["fwd"][1] <= st["bwd"][0] <= c["t0"]
            assert c["t0"] < c["t1"] <= st["bwd"][1] <= st["t1"]
            assert st["comm_total_s"] == pytest.approx(c["t1"] - c["t0"])
            assert 0 <= st["comm_exposed_s"] <= st["comm_total_s"]
        assert [st["buckets"] for st in steps[1:]] == [n_buckets] * 4
    snap = cluster.last_run
    assert all(r.steps == 5 and r.bandwidth for r in snap.ranks)


def test_a_slower_rank_is_named_and_the_others_wait_for_it(cluster):
    cluster.run_cell(textwrap.dedent("""
        import time, torch, nbdist
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(torch.nn.Linear(64, 64))
        for i in nbdist.progress(range(12)):
            time.sleep(0.03 if rank == 1 else 0.0)   # the ground truth: 30 ms more per step
            ddp(torch.randn(8, 64)).sum().backward()
    """), output="quiet")
    snap = cluster.last_run
    r0, r1 = snap.ranks
    assert snap.stragglers == (1,) and snap.diagnosis.waited_for == 1
    assert snap.diagnosis.slower_by_s == pytest.approx(0.03, abs=0.012)
    assert r0.waiting_s == pytest.approx(0.03, abs=0.012) and r1.waiting_s < 0.005
    # one bandwidth: both ranks moved the same bytes in the same transfer time
    assert r0.bandwidth == r1.bandwidth == snap.bandwidth and r0.bandwidth > 0


def test_user_fp16_hook_still_applies_and_is_timed(cluster):
    hook = ("from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"
            "ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)")
    evs_by_rank = train(cluster, hook=hook)
    grad_bytes = cluster.pull("grad_bytes")
    for evs in evs_by_rank.values():
        check_buckets(evs, 6, grad_bytes, bytes_factor=0.5, dtype="float16")
    # the hook really ran: fp16 rounding makes the result differ from an fp32 all-reduce
    fp16 = cluster.pull("final", rank=0)
    assert all((a == b).all() for a, b in zip(fp16, cluster.pull("final", rank=1)))
    train(cluster)
    fp32 = cluster.pull("final", rank=0)
    assert any(not (a == b).all() for a, b in zip(fp16, fp32))


def test_registering_a_second_hook_still_fails_like_ddp(cluster):
    with pytest.raises(DistributedError, match="can only be called once"):
        cluster.run_cell(textwrap.dedent("""
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            d = DDP(torch.nn.Linear(2, 2))
            d.register_comm_hook(None, default_hooks.allreduce_hook)
            d.register_comm_hook(None, default_hooks.fp16_compress_hook)
        """), output="quiet")


def test_explicit_collectives_are_timed_unless_opted_out(cluster):
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        t = torch.ones(1000)
        dist.all_reduce(t)
        w = dist.broadcast(torch.zeros(10, dtype=torch.float64), src=0, async_op=True)
        w.wait()
    """)
    cluster.run_cell(code, output="quiet")
    for evs in cluster.runs[-1].events().values():
        calls = {e["op"]: e for e in kinds(evs, "comm")}
        assert calls["all_reduce"]["bytes"] == 4000 and calls["all_reduce"]["bucket"] is None
        assert calls["broadcast"]["bytes"] == 80
        assert calls["all_reduce"]["t1"] >= calls["all_reduce"]["t0"]
    n = len(cluster.runs)
    cluster.run_cell(code, output="quiet", time_collectives=False)
    assert len(cluster.runs) == n, "nothing recorded: the run is not kept"


def test_no_telemetry_records_nothing_and_still_trains(cluster):
    n = len(cluster.runs)
    train(cluster, telemetry=False)
    assert len(cluster.runs) == n
    assert len(cluster.pull("final")) == 6


def test_progress_without_ddp_counts_steps(cluster):
    cluster.run_cell(textwrap.dedent("""
        import torch, nbdist
        for batch in nbdist.progress([torch.zeros(8, 3)] * 5, desc="plain"):
            s = batch.sum()
            nbdist.log(step_value=float(rank))
    """), output="quiet")
    for rank, evs in cluster.runs[-1].events().items():
        steps = kinds(evs, "step")
        assert [s["step"] for s in steps] == list(range(5))
        assert all(s["source"] == "progress" and s["samples"] == 8 for s in steps)
        assert kinds(evs, "scalars")[-1]["values"] == {"step_value": float(rank)}


def test_failed_rank_is_marked_with_its_reason(cluster):
    with pytest.raises(DistributedError):
        cluster.run_cell(textwrap.dedent("""
            import nbdist
            for i in nbdist.progress(range(4)):
                if rank == 1 and i == 2:
                    raise ValueError("bad batch on rank one")
        """), output="quiet")
    snap = cluster.last_run
    assert snap.ranks[0].state == "done"
    assert snap.ranks[1].state == "failed" and "bad batch on rank one" in snap.ranks[1].error


@pytest.mark.parametrize("bucket_timing", [False, True])
def test_timeline_writes_a_trace_with_a_track_per_rank(cluster, tmp_path, bucket_timing):
    train(cluster, steps=3, bucket_timing=bucket_timing)
    path = tmp_path / "run.json"
    count = cluster.timeline(str(path))
    trace = json.loads(path.read_text())
    assert len(trace["traceEvents"]) == count
    procs = {e["pid"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert procs == {0, 1}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "thread_name"}
    for pid in procs:
        xs = [e for e in trace["traceEvents"] if e["pid"] == pid and e["ph"] == "X"]
        names = [e["name"] for e in xs]
        assert names.count("forward") == 3 and names.count("backward") == 3
        reduces = [e for e in xs if lanes[pid, e["tid"]].startswith("all-reduce")]
        if bucket_timing:
            assert sum(n.startswith("bucket") for n in names) >= 5  # 1 + 2 + 2 buckets
            assert len(reduces) >= 5
        else:  # one span a step, from DDP's own timer
            assert [e["name"] for e in reduces] == ["all_reduce (all buckets)"] * 3


def test_timeline_magic_in_a_real_shell(cluster, tmp_path, monkeypatch):
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    import nbdist.session as session_mod

    monkeypatch.setattr(session_mod, "_default", cluster)  # the magics use this session
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    shell.run_cell_magic("distributed", "--quiet", textwrap.dedent(TRAIN).format(hook="",
                                                                                steps=2))
    path = tmp_path / "magic.json"
    shell.run_line_magic("nbdist", f"timeline {path}")
    assert json.loads(path.read_text())["traceEvents"]
    with pytest.raises(UsageError):
        shell.run_line_magic("nbdist", "timeline")


def test_ddps_timer_times_a_sample_of_short_steps_and_counts_every_steps_bytes(cluster):
    steps = 120
    evs_by_rank = train(cluster, steps=steps)
    grad_bytes = cluster.pull("grad_bytes")
    timed = {}
    for r, evs in evs_by_rank.items():
        step_events = kinds(evs, "step")
        assert [e["step"] for e in step_events] == list(range(steps))
        assert all(e["comm_bytes"] == grad_bytes for e in step_events), "every step's bytes"
        spans = {c["step"]: c for c in kinds(evs, "comm")}
        timed[r] = {e["step"] for e in step_events if e["comm_timed"]}
        assert set(spans) == timed[r], "a span for each timed step, none for the others"
        assert set(range(10)) <= timed[r], "DDP times its first ten iterations"
        for e in step_events:
            if not e["comm_timed"]:
                assert e["comm_total_s"] == e["comm_exposed_s"] == 0 and e["bwd"] is None
        # Steps of these few milliseconds are sampled, about one in 0.2 s
        short = [e["t1"] - e["t0"] for e in step_events[10:]]
        if sorted(short)[len(short) // 2] < 0.005:
            assert len(timed[r]) < 10 + (steps - 10) // 4, sorted(timed[r])
    # the ranks pace alike (powers of two): the steps matched across ranks are timed on both
    common = timed[0] & timed[1]
    snap = cluster.last_run
    assert {p.step for p in snap.series} == common
    assert snap.comm_bytes == 2 * steps * grad_bytes
    assert all(r.steps == steps and r.exposed_s is not None for r in snap.ranks)
