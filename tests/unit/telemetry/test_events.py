"""The wire format from workers to the notebook (:mod:`nbdist.telemetry.events`): plain dicts
that survive JSON, one ``kind`` each, keys that do not apply left out."""

from __future__ import annotations

import json

import pytest

from nbdist.telemetry import events as ev


def every_kind_of_event() -> list[dict]:
    return [
        ev.stream("stdout", "hi\n"), ev.warning("UserWarning", "careful", "<cell>", 3),
        ev.step(0, 1.0, 1.5, samples=32, fwd=(1.0, 1.1), bwd=(1.1, 1.4)),
        ev.comm("all_reduce", 1.4, 1.5, 4096, step=0, bucket=0, dtype="float32"),
        ev.elastic(ev.ElasticWhat.HEALED, 2.0, commit=5, world=2),
        ev.stage("forward", 3, 1, 1.0, 1.1),
        ev.pipeline(1.0, 2.0, schedule="GPipe", stages=[1], num_stages=2, microbatches=4,
                    busy_s=0.7, p2p_wait_s=0.1),
        ev.progress(0, "epoch", 3, 10, 2.0), ev.scalars({"loss": 0.5}, 2.0, step=3),
        ev.memory(2.0, params=10, grads=10, optimizer=20, rss=None, peak=None),
        ev.ddp_model(2.0, model=0, params=5, tensors=2, nbytes=20, bucket_cap_mb=25.0,
                     gradient_as_bucket_view=False, static_graph=False, comm_hook=None,
                     applied=[], explicit=["static_graph"]),
        ev.trial(3.0, steps=20, cut=True, budget=20), ev.end(True, 3.0),
        ev.stack(3.0, "stall", 12.0, [{"file": "<cell>", "line": 5, "name": "<module>",
                                       "cell": True, "code": "x", "call": "f()"}]),
        ev.debugger("enter", 3.0, line=5), ev.input_request(1, "(Pdb) "),
    ]


def test_every_event_is_a_plain_dict_that_comes_back_from_json_unchanged():
    for event in every_kind_of_event():
        assert json.loads(json.dumps(event)) == {
            k: list(v) if isinstance(v, tuple) else v for k, v in event.items()}


def test_each_builder_names_its_kind_and_the_telemetry_sets_hold_only_telemetry():
    kinds = [e["kind"] for e in every_kind_of_event()]
    assert kinds == [ev.STREAM, ev.WARNING, ev.STEP, ev.COMM, ev.ELASTIC, ev.STAGE, ev.PIPELINE,
                     ev.PROGRESS, ev.SCALARS, ev.MEMORY, ev.DDP, ev.TRIAL, ev.END, ev.STACK,
                     ev.DEBUGGER, ev.INPUT]
    assert ev.TABLED <= ev.TELEMETRY and ev.UNTIMED <= ev.TELEMETRY
    assert ev.PROGRESS_KINDS <= ev.TELEMETRY
    assert ev.STREAM not in ev.TELEMETRY and ev.END not in ev.PROGRESS_KINDS


def test_a_collective_leaves_out_what_does_not_apply():
    plain = ev.comm("all_reduce", 0.0, 1.0, 8)
    assert not {"dim", "peer", "mb"} & plain.keys()
    p2p = ev.comm("send", 0.0, 1.0, 8, dim="pp", peer=1, mb="F3")
    assert (p2p["dim"], p2p["peer"], p2p["mb"]) == ("pp", 1, "F3")
    assert "model" not in ev.memory(0.0, params=1, grads=1, optimizer=0, rss=1, peak=1)


def test_an_elastic_event_carries_its_what_as_the_plain_word():
    e = ev.elastic(ev.ElasticWhat.FAILED, 1.0, error="gone")
    assert e["what"] == "failed" and type(e["what"]) is str and e["error"] == "gone"
    assert ev.elastic("begin", 0.0)["what"] == "begin"
    with pytest.raises(ValueError):
        ev.elastic("exploded", 0.0)


def test_answers_to_debugger_prompts_have_one_key_per_rank_and_request():
    keys = {ev.answer_key("dbg/7", r, n) for r in range(3) for n in range(1, 4)}
    assert len(keys) == 9 and ev.answer_key("dbg/7", 1, 2) == "dbg/7/1/2"
