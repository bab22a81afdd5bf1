"""The ipyparallel adapter's worker half: calls travel by name, not as their code."""

from __future__ import annotations

from ipyparallel.serialize import deserialize_object, serialize_object

from nbdist.backends.ipp_events import ByName
from nbdist.runtime import results
from nbdist.runtime import worker as rt


def test_a_module_function_travels_as_its_name_and_calls_the_same_function():
    by_name = ByName.of(rt.describe)
    bufs = serialize_object(by_name)
    assert sum(len(b) for b in bufs) < 200  # ipyparallel sends describe's code: kilobytes
    assert sum(len(b) for b in serialize_object(rt.describe)) > 1000
    back, _ = deserialize_object(bufs)
    info = back(None, gpus=False)  # the very function, run where it arrives
    assert set(info) >= set(results.WorkerInfo.__annotations__) - {"worker_id"}


def test_what_has_no_importable_name_travels_as_it_is():
    def local() -> int:
        return 1

    assert ByName.of(local) is local
    assert ByName.of(lambda: 2)() == 2
