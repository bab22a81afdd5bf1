"""The torchrun contract: rank plans by host and the environment of each rank (pure)."""

import os

import pytest

from nbdist.runtime.env import (
    apply_env,
    choose_dist_backend,
    plan_ranks,
    restore_env,
    shared_gpus,
)


def worker(wid, host, ips=(), cpus=2, gpus=0, route=None):
    return {"worker_id": wid, "hostname": host, "cpu_count": cpus, "gpu_count": gpus,
            "addresses": [{"ip": "127.0.0.1", "prefix": 8, "iface": "lo"}]
            + [{"ip": ip, "prefix": 24, "iface": f"eth{i}"} for i, ip in enumerate(ips)],
            "route_ip": route}


def test_single_host_uses_loopback_and_splits_threads():
    plans = plan_ranks([worker(0, "a", ["10.0.0.5"]), worker(1, "a", ["10.0.0.5"])])
    assert [p.rank for p in plans] == [0, 1]
    assert [p.local_rank for p in plans] == [0, 1]
    assert {p.master_addr for p in plans} == {"127.0.0.1"}
    assert [p.threads for p in plans] == [1, 1]
    assert {p.ifname for p in plans} == {"lo"}
    env = plans[1].env(29500)
    assert env["RANK"] == "1" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "2"
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "0"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "29500"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["GLOO_SOCKET_IFNAME"] == "lo"


def test_ranks_grouped_by_host_with_local_ranks():
    # Workers arrive interleaved across hosts; ranks must be contiguous per host.
    ws = [worker(0, "a", ["10.0.0.1"], cpus=8), worker(1, "b", ["10.0.0.2"], cpus=8),
          worker(2, "a", ["10.0.0.1"], cpus=8), worker(3, "b", ["10.0.0.2"], cpus=8),
          worker(4, "b", ["10.0.0.2"], cpus=8)]
    plans = plan_ranks(ws)
    assert [(p.worker_id, p.rank, p.local_rank, p.node_rank) for p in plans] == [
        (0, 0, 0, 0), (2, 1, 1, 0), (1, 2, 0, 1), (3, 3, 1, 1), (4, 4, 2, 1)]
    assert [p.local_world_size for p in plans] == [2, 2, 3, 3, 3]
    assert [p.threads for p in plans] == [4, 4, 2, 2, 2]
    assert {p.master_addr for p in plans} == {"10.0.0.1"}
    assert {p.num_nodes for p in plans} == {2}
    assert {p.ifname for p in plans} == {"eth0"}


def test_master_addr_is_on_a_network_the_others_share():
    host_a = worker(0, "a", ["192.168.1.10", "10.77.0.2"], route="192.168.1.10")
    host_b = worker(1, "b", ["10.77.0.3"])
    plans = plan_ranks([host_a, host_b])
    assert plans[0].master_addr == "10.77.0.2"
    assert plans[1].ifname == "eth0"


def test_master_addr_falls_back_to_route_address():
    plans = plan_ranks([worker(0, "a", ["10.1.0.2"], route="10.1.0.2"),
                        worker(1, "b", ["10.2.0.3"])])
    assert plans[0].master_addr == "10.1.0.2"


def test_no_reachable_address_is_an_error():
    with pytest.raises(ValueError, match="reachable"):
        plan_ranks([worker(0, "a"), worker(1, "b", ["10.2.0.3"])])


def test_gpus_pinned_by_local_rank_and_threads_override():
    plans = plan_ranks([worker(i, "gpubox", cpus=16, gpus=4) for i in range(4)], threads=3)
    assert [p.gpu for p in plans] == [0, 1, 2, 3]
    assert {p.threads for p in plans} == {3}
    assert [p.gpu for p in plan_ranks([worker(0, "h", gpus=2)], use_gpus=False)] == [None]


def test_apply_and_restore_env():
    target = {"RANK": "7", "KEEP": "x"}
    prev = apply_env(target, {"RANK": "0", "WORLD_SIZE": "2"})
    assert target == {"RANK": "0", "WORLD_SIZE": "2", "KEEP": "x"}
    restore_env(target, prev)
    assert target == {"RANK": "7", "KEEP": "x"}
    assert "NBDIST_NEVER_SET" not in os.environ


def test_empty_plan_is_an_error():
    with pytest.raises(ValueError, match="no workers"):
        plan_ranks([])


def test_shared_gpus_are_found_per_host():
    two_on_one = plan_ranks([worker(1, "a", ["10.0.0.5"], gpus=1),
                             worker(2, "a", ["10.0.0.5"], gpus=1),
                             worker(3, "b", ["10.0.0.6"], gpus=1)])
    assert shared_gpus(two_on_one) == {("a", 0): [0, 1]}
    one_each = plan_ranks([worker(1, "a", gpus=2), worker(2, "a", gpus=2)])
    assert shared_gpus(one_each) == {}
    assert shared_gpus(plan_ranks([worker(1, "a"), worker(2, "a")])) == {}


@pytest.mark.parametrize("gpus,n,asked,chosen", [
    (1, 2, "auto", "gloo"),  # a one-GPU machine: the ranks share GPU 0
    (2, 2, "auto", "auto"),  # one GPU each: every rank picks NCCL on its GPU
    (2, 3, "auto", "gloo"),  # rank 2 shares GPU 0 with rank 0
    (0, 2, "auto", "auto"),  # CPU: gloo, as the ranks pick
    (1, 2, "gloo", "gloo"),
    (2, 2, "nccl", "nccl"),
])
def test_the_dist_backend_for_ranks_that_do_or_do_not_share_a_gpu(gpus, n, asked, chosen):
    plans = plan_ranks([worker(i, "a", gpus=gpus) for i in range(n)])
    backend, note = choose_dist_backend(asked, plans)
    assert backend == chosen
    if chosen == "gloo" and asked == "auto":
        assert note.startswith("ranks 0, 1 share GPU 0 on a" if n == 2 else
                               "ranks 0, 2 share GPU 0 on a")
        assert "NCCL needs one GPU per rank: the process group uses gloo" in note
    else:
        assert note == ""


def test_nccl_on_a_shared_gpu_is_refused_naming_it():
    plans = plan_ranks([worker(i, h, [f"10.0.0.{i + 5}"], gpus=1) for i, h in enumerate("aabb")])
    with pytest.raises(ValueError, match=r"ranks 0, 1 share GPU 0 on a \(and 1 more GPU is "
                                         r"shared\)"):
        choose_dist_backend("nccl", plans)
    assert choose_dist_backend("nccl", plan_ranks([worker(1, "a", gpus=1)])) == ("nccl", "")
    cpu = plan_ranks([worker(i, "a", gpus=1) for i in range(2)], use_gpus=False)
    assert choose_dist_backend("auto", cpu) == ("auto", "")  # --device cpu: nothing shared


def test_workers_keep_their_gpu_and_a_newcomer_takes_the_free_one():
    """Rank 0 (GPU 0) died: the survivor, now rank 0, stays on GPU 1, where its tensors are,
    and the replacement takes GPU 0, not GPU 1 by its local rank."""
    survivor, newcomer = worker("w1", "a", gpus=2), worker("w9", "a", gpus=2)
    plans = plan_ranks([survivor, newcomer], pinned={"w1": 1})
    assert [(p.rank, p.worker_id, p.gpu) for p in plans] == [(0, "w1", 1), (1, "w9", 0)]
    assert shared_gpus(plans) == {}
    fresh = plan_ranks([worker(i, "a", gpus=2) for i in range(3)])
    assert [p.gpu for p in fresh] == [0, 1, 0]  # more workers than GPUs: by local rank
    assert [p.gpu for p in plan_ranks([survivor], pinned={"w1": 1}, use_gpus=False)] == [None]
