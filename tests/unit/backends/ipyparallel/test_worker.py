"""The ipyparallel adapter's worker half: calls travel by name, not as their code."""

from __future__ import annotations

from ipyparallel.serialize import deserialize_object, serialize_object

from nbdist.backends.ipyparallel.worker import ByName
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


def test_a_bound_call_is_one_small_pickle_that_runs_the_call_where_it_arrives():
    fn, args, kwargs = ByName.bind(rt.describe, (None,), {"gpus": False})
    assert (args, kwargs) == ((), {})  # the arguments travel inside the call
    bufs = serialize_object(fn)
    assert len(bufs) == 1 and len(bufs[0]) < 300
    back, _ = deserialize_object(bufs)
    assert set(back()) >= set(results.WorkerInfo.__annotations__) - {"worker_id"}


def test_buffers_stay_arguments_of_their_own_so_ipyparallel_sends_them_uncopied():
    big = b"x" * (2 << 20)
    for args in ((big,), ([big],), ({"b": memoryview(big)},)):
        fn, sent, _ = ByName.bind(rt.describe, args, {})
        assert isinstance(fn, ByName) and not fn.args and sent == args
        arg_bufs = serialize_object(sent[0], buffer_threshold=1 << 20)
        assert any(isinstance(b, (bytes, memoryview)) and len(b) == len(big) for b in arg_bufs)
    fn, sent, _ = ByName.bind(rt.describe, (), {"data": big})
    assert not fn.args and not fn.kwargs  # a buffer among the keyword arguments too


def test_a_function_without_a_name_is_sent_with_its_arguments_as_they_are():
    def local(a: int, b: int = 0) -> int:
        return a + b

    assert ByName.bind(local, (1,), {"b": 2}) == (local, (1,), {"b": 2})


def _engine_runs(packed):
    """What an engine does with an apply request: unpack the call, run it."""
    from ipyparallel.serialize import pack_apply_message, unpack_apply_message

    f, args, kwargs = unpack_apply_message(pack_apply_message(*packed))
    return f(*args, **kwargs)


def test_a_call_is_packed_as_one_pickle_or_argument_by_argument_when_pickle_refuses_one():
    from nbdist.backends.base import Call
    from nbdist.backends.ipyparallel.adapter import _pack

    bound = _pack(Call(0, rt.describe, (None,), {"gpus": False}))
    assert bound[1:] == ([], {})  # the arguments travel inside the call
    assert "hostname" in _engine_runs(bound)
    offset = 5
    # a closure pickle cannot send by reference: ipyparallel cans it, and the call still runs
    unbound = _pack(Call(0, rt.describe, (None,), {"gpus": False, "x": lambda: offset}))
    assert len(unbound[1]) == 1 and set(unbound[2]) == {"gpus", "x"}
    f, args, kwargs = unbound
    from ipyparallel.serialize import pack_apply_message, unpack_apply_message

    _, _, sent = unpack_apply_message(pack_apply_message(f, args, kwargs))
    assert sent["x"]() == 5
