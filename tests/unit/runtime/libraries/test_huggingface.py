"""Hugging Face's Trainer in a cell reports what it logs and how far it is, with no nbdist line
in the training code: the reporter's values are the Trainer's own log history, its bar its
optimizer steps, and nothing is reported outside cells. One process, a tiny BERT built from a
config, synthetic data, the CPU."""

from __future__ import annotations

import sys

import pytest
from synthetic import Sink

from nbdist.runtime.measure.model import measurements
from nbdist.runtime.measure.spec import Measure

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


class Tokens(torch.utils.data.Dataset):
    """``n`` sequences of 8 token ids with a label each, the same on every run."""

    def __init__(self, n: int = 16) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 50, (8,), generator=g), "labels": torch.tensor(i % 2)}


def trainer(tmp_path, **args) -> transformers.Trainer:
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=16, num_labels=2)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=8,
        max_steps=4, logging_steps=2, report_to=[], use_cpu=True, save_strategy="no",
        **args)
    return transformers.Trainer(model=model, args=targs, train_dataset=Tokens(),
                                eval_dataset=Tokens(8))


@pytest.fixture
def cell():
    sink = Sink()
    measurements.begin_cell(sink, Measure(telemetry=True))
    try:
        yield sink
    finally:
        measurements.end_cell()


def test_the_trainers_logs_are_the_ranks_values_and_its_steps_its_bar(cell, tmp_path):
    t = trainer(tmp_path, disable_tqdm=True)
    t.train()
    metrics = t.evaluate()
    reported = [e["values"] for e in cell.kinds("scalars")]
    # what the Trainer logged, less the counts that are not values
    logged = [{k: float(v) for k, v in h.items() if k not in ("epoch", "step", "total_flos")}
              for h in t.state.log_history]
    assert reported == logged
    assert {"loss", "learning_rate", "grad_norm"} <= set(reported[0])
    assert reported[-1]["eval_loss"] == pytest.approx(metrics["eval_loss"])
    bars = cell.kinds("progress")
    assert [b["n"] for b in bars][-1] == 4 and bars[-1]["done"] and bars[0]["total"] == 4
    assert {b["bar"] for b in bars} == {1}  # one bar, the training's


def test_where_transformers_draws_its_bar_the_reporter_draws_none(cell, tmp_path):
    # the world's process zero with tqdm on: transformers' tqdm bar is the rank's progress
    # (nbdist's tqdm bars report it), a second bar would count the same steps twice
    t = trainer(tmp_path, disable_tqdm=False)
    t.train()
    assert cell.kinds("progress") == []
    assert cell.kinds("scalars")


def test_the_reporter_is_in_trainers_made_in_cells_only_and_silent_outside(tmp_path):
    from transformers import trainer as module

    sink = Sink()
    measurements.begin_cell(sink, Measure(telemetry=True))
    made_in_cell = trainer(tmp_path, disable_tqdm=True)
    measurements.end_cell()
    names = [type(c).__name__ for c in made_in_cell.callback_handler.callbacks]
    assert "Reporter" in names
    assert not any(c.__name__ == "Reporter" for c in module.DEFAULT_CALLBACKS)
    made_outside = trainer(tmp_path, disable_tqdm=True)
    assert "Reporter" not in [type(c).__name__ for c in made_outside.callback_handler.callbacks]
    made_in_cell.train()  # between cells: the reporter says nothing, and training works
    assert sink.events == [] and made_in_cell.state.global_step == 4
    assert "transformers.trainer" in sys.modules
