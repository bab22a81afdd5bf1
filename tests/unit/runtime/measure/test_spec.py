"""What a cell measures (:mod:`nbdist.runtime.measure.spec`): one record that travels whole to
each rank, with the DDP setting its models are built with."""

from __future__ import annotations

import pickle
from dataclasses import fields

import pytest

from nbdist.runtime.measure.spec import COMM_HOOKS, DDP_KNOBS, DEFAULT, DDPSettings, Measure


def test_a_setting_says_what_it_sets_in_order_and_names_itself_by_it():
    assert DDPSettings().given() == {} and DDPSettings().label == "torch's defaults"
    s = DDPSettings(comm_hook="fp16", bucket_cap_mb=5.0, static_graph=False)
    assert list(s.given()) == ["bucket_cap_mb", "static_graph", "comm_hook"]
    assert s.label == "bucket_cap_mb=5, static_graph=False, comm_hook=fp16"
    assert DDPSettings(bucket_cap_mb=0.5).label == "bucket_cap_mb=0.5"


def test_only_a_compression_hook_changes_the_gradients():
    assert [DDPSettings(comm_hook=h).lossy for h in COMM_HOOKS] == [True] * len(COMM_HOOKS)
    assert not DDPSettings(bucket_cap_mb=1.0, gradient_as_bucket_view=True,
                           static_graph=True).lossy
    assert set(DDP_KNOBS) | {"comm_hook"} == {f.name for f in fields(DDPSettings)}


def test_override_puts_in_only_what_was_given():
    m = DEFAULT.override(telemetry=False, stall_after=None, trial_steps=20)
    assert (m.telemetry, m.stall_after, m.trial_steps) == (False, None, 20)
    assert m.collectives is DEFAULT.collectives and DEFAULT.telemetry  # the default unchanged
    assert DEFAULT.override() == DEFAULT


def test_the_record_travels_whole_and_profile_keys_are_spelled_once():
    m = Measure(buckets=True, stall_after=30.0, ddp=DDPSettings(comm_hook="bf16"))
    assert pickle.loads(pickle.dumps(m)) == m
    keys = [f.metadata.get("profile") for cls in (Measure, DDPSettings) for f in fields(cls)]
    named = [k for k in keys if k]
    assert len(named) == len(set(named)) and all(k.startswith("training.") for k in named)
    with pytest.raises(AttributeError):
        m.telemetry = False  # frozen: one DEFAULT serves every cell
