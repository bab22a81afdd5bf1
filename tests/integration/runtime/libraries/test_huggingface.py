"""Hugging Face's Trainer on 2 ranks, as a user writes it, with no nbdist line in the code: in a
``%%distributed`` cell and through ``%nbdist run`` it trains the same weights, bit for bit, as
the same script under a real ``torchrun --nproc_per_node=2`` (train, evaluate, ``save_model``),
the cell run again does too, and the dashboard's record has the Trainer's logged values, its
optimizer steps and samples per second, from the cell and from the script alike. A tiny BERT
built from a config, synthetic tokens, the CPU; one cluster per engine for the module (importing
transformers takes seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torchrun_runs
from clusters import ENGINES, start_session

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.timeout(600)

MAX_STEPS = 6

TRAIN = f'''
import sys
import torch
import transformers


class Tokens(torch.utils.data.Dataset):
    """Sequences of 8 token ids with a label each, the same on every run."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {{"input_ids": torch.randint(0, 50, (8,), generator=g),
                "labels": torch.tensor(i % 2)}}


def train(out):
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=16, num_labels=2)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        max_steps={MAX_STEPS}, logging_steps=2, learning_rate=1e-3, report_to=[],
        use_cpu=True, save_strategy="no", seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(64),
                                   eval_dataset=Tokens(16))
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(out)
    return metrics
'''

MAIN = '''
if __name__ == "__main__":
    train(sys.argv[1])
'''


def weights(out: Path) -> dict:
    return safetensors_torch.load_file(str(out / "model.safetensors"))


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"weights differ from torchrun's: {differ[:5]}"


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "train.py"
    path.write_text(TRAIN + MAIN)
    return path


@pytest.fixture(scope="module")
def under_torchrun(script) -> dict:
    """The weights the script saves under torchrun, 2 ranks on this host."""
    out = script.parent / "torchrun"
    torchrun_runs.under_torchrun(script, out)
    return weights(out)


@pytest.fixture(scope="module", params=ENGINES)
def session(request):
    s = start_session(request.param, 2)
    try:
        yield s
    finally:
        s.stop()


def test_the_trainer_in_a_cell_trains_torchruns_weights_and_lights_up_the_dashboard(
        session, script, under_torchrun, tmp_path):
    for attempt in ("first", "again"):  # the training cell run again
        out = tmp_path / attempt
        session.run_cell(TRAIN + f"\nmetrics = train({str(out)!r})\n", output="quiet",
                         timeout=300)
        assert_same(weights(out), under_torchrun)
        run = session.last_run
        assert run is not None and run.steps == MAX_STEPS
        for name in ("loss", "learning_rate", "grad_norm", "eval_loss"):
            assert set(run.scalar_series.get(name, {})) == {0, 1}, name  # every rank's
        assert len(run.scalar_series["loss"][0]) == MAX_STEPS // 2  # logging_steps=2
        assert "epoch" not in run.scalar_series
        assert all(r.samples_per_s and r.samples_per_s > 0 for r in run.ranks)
        # rank 0's bars are transformers' tqdm bars; rank 1's, where it draws none, the steps
        assert all(r.bar is not None for r in run.ranks)
        bar = next(r.bar for r in run.ranks if r.rank == 1)
        assert (bar.n, bar.total, bar.done) == (MAX_STEPS, MAX_STEPS, True)
        evaluated = session.pull("metrics", rank=0)["eval_loss"]
        assert run.scalar_series["eval_loss"][0][-1][1] == pytest.approx(evaluated)


def test_the_trainer_through_nbdist_run_trains_torchruns_weights_and_lights_up_the_dashboard(
        session, script, under_torchrun, tmp_path):
    out = tmp_path / "run"
    before = session.cells.runs[-1] if session.cells.runs else None
    session.run_script(str(script), [str(out)], timeout=300, output="quiet")
    assert_same(weights(out), under_torchrun)
    assert session.cells.runs and session.cells.runs[-1] is not before, "the run recorded nothing"
    run = session.last_run
    assert run is not None and run.steps == MAX_STEPS
    for name in ("loss", "learning_rate", "grad_norm", "eval_loss"):
        assert set(run.scalar_series.get(name, {})) == {0, 1}, name  # every rank's
    assert len(run.scalar_series["loss"][0]) == MAX_STEPS // 2  # logging_steps=2
    assert all(r.samples_per_s and r.samples_per_s > 0 for r in run.ranks)
    bar = next(r.bar for r in run.ranks if r.rank == 1)
    assert bar is not None and (bar.n, bar.total, bar.done) == (MAX_STEPS, MAX_STEPS, True)


def test_the_trainers_log_lines_reach_the_cell_as_under_torchrun(session, tmp_path, capsys):
    """Rank 0's printed logs (the Trainer writes each log as a line under its bar) show in the
    cell: a rank that looked like a notebook kernel drew them with display(), and they were
    lost (or printed as an object's repr)."""
    capsys.readouterr()
    session.run_cell(TRAIN + f"\nmetrics = train({str(tmp_path / 'out')!r})\n", timeout=300)
    out, err = capsys.readouterr()
    text = out + err
    logged = [line for line in text.splitlines() if "'loss':" in line]
    assert len(logged) == MAX_STEPS // 2, text[-3000:]  # logging_steps=2
    assert all("'learning_rate':" in line for line in logged), logged
    # and the end of training's summary line, as torchrun's log has it (evaluate() logs to the
    # dashboard only: the Trainer prints logs under its training bar, closed by then)
    assert any("'train_runtime':" in line for line in text.splitlines()), text[-3000:]
    assert "IPython.core.display" not in text and "\x1b[" not in text, text[-3000:]
