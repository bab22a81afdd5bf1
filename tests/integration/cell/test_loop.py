"""Integration: %%distributed semantics on a real 2-worker cluster, for every engine."""

from __future__ import annotations

import textwrap

import pytest
import torch
from clusters import check_ddp_matches_union_batch

from nbdist.errors import CellTimeoutError, DistributedError

pytestmark = pytest.mark.timeout(240)


def cell(session, code, **kw):
    kw.setdefault("output", "quiet")
    return session.run_cell(textwrap.dedent(code), **kw)


def test_all_reduce_and_torchrun_env(cluster):
    cell(cluster, """
        import os, torch, torch.distributed as dist
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        info = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING")}
        info.update(sum=t.item(), rank=rank, local_rank=local_rank, world_size=world_size,
                    device=str(device), threads=torch.get_num_threads(),
                    backend=dist.get_backend(), pg_rank=dist.get_rank())
    """)
    infos = [cluster.pull("info", rank=r) for r in range(2)]
    for r, info in enumerate(infos):
        assert info["sum"] == 3.0
        assert info["RANK"] == str(r) == str(info["rank"]) == str(info["pg_rank"])
        assert info["LOCAL_RANK"] == str(r) == str(info["local_rank"])
        assert info["WORLD_SIZE"] == "2" and info["LOCAL_WORLD_SIZE"] == "2"
        assert info["GROUP_RANK"] == "0" and info["world_size"] == 2
        assert info["MASTER_ADDR"] == "127.0.0.1"
        assert info["MASTER_PORT"] == str(cluster.port)
        assert info["device"] == "cpu" and info["backend"] == "gloo"
        # an NCCL error aborts the communicator and fails the cell; the worker lives on
        assert info["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
        # 2 workers on this host share its cores instead of oversubscribing them.
        assert info["threads"] == max(1, cluster.plans[r].threads)


def test_last_expression_is_the_result_of_rank0(cluster):
    value = cell(cluster, "rank * 10 + 7")
    assert repr(value) == "7"
    assert cell(cluster, "rank * 10 + 7", ranks="1").data["text/plain"] == "17"
    assert cell(cluster, "x = 1") is None


def test_state_persists_across_cells(cluster):
    cell(cluster, "import torch\ncounter = torch.zeros(1) + rank")
    cell(cluster, "counter += 5")
    assert cluster.pull("counter", rank=0).item() == 5
    assert cluster.pull("counter", rank=1).item() == 6


def test_push_pull_round_trip(cluster):
    weights = torch.arange(6.0).reshape(2, 3)
    model = torch.nn.Linear(3, 2)
    cluster.push({"weights": weights, "sd": model.state_dict(), "scale": 2.5})
    cell(cluster, """
        import torch
        net = torch.nn.Linear(3, 2).to(device)
        net.load_state_dict(sd)
        doubled = weights * scale
    """)
    back = cluster.pull("doubled", rank=1)
    assert torch.equal(back, weights * 2.5)
    net = cluster.pull("net")
    assert isinstance(net, torch.nn.Linear)
    for k, v in model.state_dict().items():
        assert torch.equal(net.state_dict()[k], v)
    with pytest.raises(NameError, match="not defined"):
        cluster.pull("no_such_name")


def test_ddp_matches_single_process_training_on_the_union_batch(cluster):
    check_ddp_matches_union_batch(cluster)


def test_error_on_rank1_is_raised_with_cell_line_and_next_cell_runs(cluster):
    with pytest.raises(DistributedError) as info:
        cell(cluster, """
            import torch, torch.distributed as dist
            t = torch.ones(1)
            if rank == 1:
                raise ValueError("bad shard on rank one")
            dist.all_reduce(t)
        """)
    err = info.value
    assert [f.rank for f in err.causes] == [1]
    assert "rank 1" in str(err) and "bad shard on rank one" in str(err)
    assert err.causes[0].line == 5
    rendered = "\n".join(err._render_traceback_())
    assert 'line 5' in rendered and 'raise ValueError("bad shard on rank one")' in rendered
    # Rank 0 was blocked in all_reduce; it must have been released, not timed out.
    assert err.failures[0].rank == 0 and err.failures[0].caused_by_peer
    # The cluster is usable right after, with a re-formed group.
    cell(cluster, "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)")
    assert cluster.pull("t").item() == 3.0


def test_syntax_error_is_reported_before_shipping(cluster):
    cell(cluster, "marker = 1")
    with pytest.raises(SyntaxError):
        cell(cluster, "marker = 2\nfor x in :\n    pass")
    assert cluster.pull("marker") == 1


def test_rank_selection(cluster):
    cell(cluster, "only = -1")
    cell(cluster, "only = rank", ranks="1")
    assert cluster.pull("only", rank=0) == -1
    assert cluster.pull("only", rank=1) == 1
    with pytest.raises(ValueError, match="out of range"):
        cell(cluster, "x = 1", ranks="5")
    # A plain code error on a subset of ranks gets no advice about collectives.
    with pytest.raises(DistributedError) as info:
        cell(cluster, "raise KeyError('nope')", ranks="1")
    assert info.value.ranks == [1] and "collectives" not in info.value.remedy


def test_output_streams_live_with_rank_prefix(cluster, capsys):
    cell(cluster, """
        import sys
        print("hello from", rank)
        print("warn from", rank, file=sys.stderr)
    """, output="all")
    out, err = capsys.readouterr()
    assert "[0] hello from 0" in out and "[1] hello from 1" in out
    assert "[0] warn from 0" in err and "[1] warn from 1" in err
    cell(cluster, "print('only rank zero shows', rank)", output="rank0")
    out, _ = capsys.readouterr()
    assert "[0] only rank zero shows 0" in out and "[1]" not in out


def test_torchrun_init_in_a_cell_is_harmless(cluster):
    value = cell(cluster, """
        import torch.distributed as dist
        dist.init_process_group("gloo")   # as a torchrun script would
        dist.get_world_size()
    """)
    assert repr(value) == "2"


def test_user_destroying_the_group_gets_a_fresh_one_next_cell(cluster):
    cell(cluster, "import torch.distributed as dist\ndist.destroy_process_group()")
    value = cell(cluster, "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
    assert repr(value) == "2.0"


TORCHRUN_SCRIPT = """
import argparse, os, sys
import torch, torch.distributed as dist

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scale", type=float, default=1.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")            # env:// as under torchrun
    local_rank = int(os.environ["LOCAL_RANK"])
    t = torch.tensor([float(dist.get_rank() + 1)]) * args.scale
    dist.all_reduce(t)
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.txt"), "w") as f:
        f.write(f"{__name__} {local_rank} {dist.get_world_size()} {t.item()} {sys.argv[1:]}")
    print("script done on", dist.get_rank())
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
"""


def test_torchrun_script_runs_unchanged(cluster, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    cluster.run_script(str(script), ["--out", str(tmp_path), "--scale", "2"])
    for r in range(2):
        name, local_rank, world, total, argv = (tmp_path / f"rank{r}.txt").read_text().split(
            " ", 4)
        assert name == "__main__" and local_rank == str(r) and world == "2"
        assert float(total) == 6.0  # (1 + 2) * 2
        assert argv == repr(['--out', str(tmp_path), '--scale', '2'])
    assert "[0] script done on 0" in capsys.readouterr().out
    # The warm group of the cells is untouched by the script's own group.
    value = cell(cluster, "import torch, torch.distributed as dist\n"
                          "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
    assert repr(value) == "2.0"


def test_failing_script_names_the_rank(cluster, tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '1':\n"
                      "    sys.exit('rank one gives up')\n")
    with pytest.raises(DistributedError) as info:
        cluster.run_script(str(script), output="quiet")
    assert [f.rank for f in info.value.causes] == [1]
    assert "exited with status 1" in str(info.value)


def test_workers_listen_on_loopback_only(cluster):
    import psutil

    pids = [row.pid for row in cluster.status().rows]
    assert len(pids) == 2 and all(pids)
    listening = [(pid, c.laddr) for pid in pids
                 for c in psutil.Process(pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening, "rank 0 hosts the rendezvous store, so something must listen"
    assert all(addr.ip == "127.0.0.1" for _, addr in listening), listening


def test_timeout_releases_a_rank_blocked_in_a_collective(cluster):
    import time

    cell(cluster, "import torch, torch.distributed as dist")
    started = time.monotonic()
    # Rank 1 does not take part, so rank 0 waits in native code that ignores interrupts;
    # the cluster's collective timeout (60 s here) must not be what ends it.
    with pytest.raises(CellTimeoutError, match="collectives need every rank") as info:
        cell(cluster, "t = torch.ones(1)\ndist.all_reduce(t)", ranks="0", timeout=2)
    assert info.value.ranks == [0]
    assert time.monotonic() - started < 20
    value = cell(cluster, "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()")
    assert repr(value) == "3.0"
