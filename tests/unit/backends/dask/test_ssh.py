"""nbdist's SSH cluster for Dask: a replacement worker goes to the host short of its share."""

from __future__ import annotations

from nbdist.backends.dask.ssh import SSHWorkers


def test_ssh_replacements_go_to_the_host_short_of_its_share():
    class Fake:
        hosts = {"a": 2, "b": 2}
        _avoid: frozenset = frozenset()
        worker_spec = {0: {"options": {"address": "a"}}, 1: {"options": {"address": "a"}},
                       3: {"options": {"address": "b"}}}

        def _spec(self, host):
            return {"options": {"address": host}}

    assert SSHWorkers.new_worker_spec(Fake()) == {4: {"options": {"address": "b"}}}
