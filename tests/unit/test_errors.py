"""Multi-rank errors: causes before consequences, identical causes grouped, a cap on tracebacks."""

from __future__ import annotations

from nbdist.errors import MAX_TRACEBACKS, DistributedError, RankFailure, WorkersDidNotStart


def failure(rank, evalue="division by zero", line=2, **kw):
    return RankFailure(rank, f"host{rank // 4}", "ZeroDivisionError", evalue,
                       f"Traceback (most recent call last):\n  line {line}\nZeroDivisionError: "
                       f"{evalue}\n", line, **kw)


def rendered(err):
    return "\n".join(err._render_traceback_())


def test_identical_causes_share_one_traceback():
    err = DistributedError([failure(r) for r in range(32)])
    text = rendered(err)
    assert text.count("Traceback (most recent call last)") == 1
    assert "ranks 0-31 on host0, host1, host2, host3, host4, host5, host6, host7: " \
           "ZeroDivisionError: division by zero (cell line 2) (same traceback)" in text
    assert str(err).startswith("cell failed on ranks 0-31: ZeroDivisionError")


def test_distinct_causes_are_capped():
    err = DistributedError([failure(r, evalue=f"case {r}") for r in range(10)])
    text = rendered(err)
    assert text.count("Traceback (most recent call last)") == MAX_TRACEBACKS
    assert "... and 6 more distinct error(s) on rank(s) 4-9; see .failures" in text
    assert len(err.failures) == 10


def test_consequences_are_listed_by_headline_after_the_causes():
    peer = RankFailure(0, "hostA", "RuntimeError", "Connection closed by peer",
                       communication=True, caused_by_peer=True)
    err = DistributedError([peer, failure(1)], remedy="Do this.")
    lines = err._render_traceback_()
    assert lines[-1] == "Do this."
    assert "--- rank 0 on hostA: RuntimeError: Connection closed by peer" in lines
    assert rendered(err).index("rank 1") < rendered(err).index("--- rank 0")


def test_only_peer_losses_still_name_a_cause():
    both = [RankFailure(r, "h", "RuntimeError", "Connection reset by peer", communication=True,
                        caused_by_peer=True) for r in (0, 1)]
    assert DistributedError(both).causes == both


def test_workers_did_not_start_keeps_its_facts():
    err = WorkersDidNotStart("dask", 1, 4, 30.0, "TimeoutError: no workers")
    assert (err.engine, err.ready, err.wanted, err.timeout) == ("dask", 1, 4, 30.0)
    assert "only 1 of 4 dask workers started within 30 s (TimeoutError: no workers)" in str(err)


def test_distributed_error_names_cause_and_consequences():
    cause = RankFailure(1, "hostB", "ZeroDivisionError", "division by zero",
                        "Traceback...\n  File \"<distributed cell 3>\", line 2\n", line=2)
    peer = RankFailure(0, "hostA", "RuntimeError", "[pair.cc:553] Connection closed by peer",
                       communication=True, caused_by_peer=True)
    err = DistributedError([peer, cause])
    assert err.ranks == [0, 1]
    assert err.causes == [cause]
    assert "rank 1" in str(err) and "ZeroDivisionError" in str(err)
    assert "rank 0 stopped because of it" in str(err)
    text = rendered(err)
    assert "rank 1 on hostB" in text and "cell line 2" in text
    assert "<distributed cell 3>" in text
