"""RunCard after a real run: fields against what the run did (losses the module returned, checkpoint files on
disk, installed versions, the command line), the Markdown card, and a card after a failure."""

from __future__ import annotations

import json
import shlex
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from tiny_lm import MICRO_BATCH, SEQ, TinyLM, loader, make_trainer

from lightning_moe.callbacks import HealthCheck, PeakMemory, RunCard, Throughput
from lightning_moe.callbacks.step_end import StepSeries


class Data(pl.LightningDataModule):
    global_batch_size = 2 * MICRO_BATCH
    micro_batch_size = MICRO_BATCH
    seq_length = SEQ

    def train_dataloader(self):
        return loader()


class Losses(pl.Callback):
    """Each micro-batch's returned mean loss and its label count."""

    def __init__(self) -> None:
        self.micro: list[tuple[float, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # automatic optimization hands callbacks the loss divided by the accumulation factor
        loss = float(outputs["loss"]) * trainer.accumulate_grad_batches
        self.micro.append((loss, int((batch["labels"] != -100).sum())))

    def step_mean(self, step: int, accumulate: int) -> float:
        micro = self.micro[(step - 1) * accumulate : step * accumulate]
        return sum(loss * labels for loss, labels in micro) / sum(labels for _, labels in micro)


def test_run_card_fields_and_files(tmp_path, capsys):
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, save_last=True)
    losses = Losses()
    callbacks = [Throughput(window=2), PeakMemory(), HealthCheck(), RunCard(name="tiny-llama", workload="pretrain"),
                 losses, checkpoints]
    trainer = make_trainer(tmp_path, callbacks, max_steps=4, accumulate_grad_batches=2, enable_checkpointing=True)
    trainer.fit(TinyLM(), datamodule=Data())

    run_dir = tmp_path / "run" / "version_0"
    card = json.loads((run_dir / "run_card.json").read_text())
    assert card["name"] == "tiny-llama" and card["workload"] == "pretrain" and card["status"] == "completed"
    assert card["model"]["class"] == "Decoder" and card["model"]["pattern"] == "*-*-"
    assert card["model"]["parameters"] == sum(p.numel() for p in TinyLM().parameters())
    assert (card["world_size"], card["global_batch_size"], card["micro_batch_size"], card["seq_length"]) == (
        1, 4, 2, SEQ)
    assert card["precision"] == "32-true" and card["steps"] == 4

    step_losses = card["series"]["loss"]
    assert card["series"]["step"] == [0, 1, 2, 3]  # as the loggers number optimizer steps 1-4
    assert step_losses == pytest.approx([losses.step_mean(step, 2) for step in (1, 2, 3, 4)], rel=1e-5)
    assert card["initial_loss"] == step_losses[0] and card["final_loss"] == step_losses[-1]
    assert all(t > 0 for t in card["series"]["step_time_s"])
    assert card["tokens_per_s_per_gpu"] > 0 and card["tflops_per_gpu"] > 0
    # CPU: MFU against this machine's measured matmul peak
    assert card["mfu"] == pytest.approx(card["tflops_per_gpu"] * 1e12 / card["peak_flops_per_gpu"])
    assert card["peak_flops_source"].startswith("measured")
    assert card["peak_rss_gib"] > 0 and card["skipped_steps"] == 0 and card["nan_steps"] == 0

    on_disk = sorted(str(p) for p in (tmp_path / "ckpt").iterdir())
    assert len(on_disk) == 3  # steps 2 and 4, and last
    assert sorted(card["checkpoints"]) == on_disk

    assert card["versions"]["torch"] == torch.__version__
    assert card["versions"]["lightning"] == pl.__version__
    assert card["command"] == shlex.join(sys.argv)

    markdown = (run_dir / "run_card.md").read_text()
    assert markdown.startswith("# Run card: tiny-llama")
    assert "| Skipped / NaN steps | 0 / 0 |" in markdown
    assert "| Global / micro batch size | 4 / 2 |" in markdown
    assert markdown in capsys.readouterr().out
    assert sorted(p.name for p in run_dir.iterdir() if "run_card" in p.name) == ["run_card.json", "run_card.md"]


def test_run_card_is_written_when_the_run_fails(tmp_path):
    class Crashes(TinyLM):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 2:
                raise RuntimeError("data went missing")
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(tmp_path, [RunCard(print_card=False)], max_steps=5)
    with pytest.raises(RuntimeError, match="data went missing"):
        trainer.fit(Crashes(), loader())
    card = json.loads((tmp_path / "run" / "version_0" / "run_card.json").read_text())
    assert card["status"] == "failed: RuntimeError: data went missing"
    assert card["series"]["step"] == [0, 1] and card["steps"] == 2


def test_without_step_stats_the_card_takes_the_last_micro_batch_loss(tmp_path):
    class NoStats(TinyLM):
        def on_before_optimizer_step(self, optimizer):
            pass  # a module that does not report StepStats

    losses = Losses()
    trainer = make_trainer(tmp_path, [RunCard(print_card=False), losses], max_steps=3, accumulate_grad_batches=2)
    trainer.fit(NoStats(), loader())
    card = json.loads((tmp_path / "run" / "version_0" / "run_card.json").read_text())
    last_micro = [losses.micro[2 * step - 1][0] for step in (1, 2, 3)]
    assert card["series"]["loss"] == pytest.approx(last_micro, rel=1e-6)


def test_long_runs_keep_an_evenly_thinned_series():
    series = StepSeries(limit=100)
    for step in range(1, 1001):
        series.add(step, float(step))
    steps = list(series.by_step)
    assert 50 <= len(steps) <= 100
    assert steps == list(range(series.stride, 1001, series.stride)) and series.stride == 16


def test_an_early_stop_is_named_and_later_commands_leave_the_card(tmp_path):
    """EarlyStopping's reason is the card's status; a validate and a failing predict on the same trainer afterwards
    (as a notebook does) neither rewrite nor replace it."""
    from lightning.pytorch.callbacks import EarlyStopping

    class Evaluated(TinyLM):
        def validation_step(self, batch, batch_idx):
            out = self.model(batch["input_ids"], batch["position_ids"], labels=batch["labels"])
            self.log("val/loss", out.loss_sum / out.num_label_tokens)

        def predict_step(self, batch, batch_idx):
            raise ValueError("no prompts here")

    stop = EarlyStopping(monitor="val/loss", stopping_threshold=100.0)  # any finite loss is below it
    trainer = make_trainer(tmp_path, [RunCard(print_card=False), stop], max_steps=20, val_check_interval=2)
    module = Evaluated()
    trainer.fit(module, loader(), loader(rows=4))
    path = tmp_path / "run" / "version_0" / "run_card.json"
    card = json.loads(path.read_text())
    assert trainer.global_step == 2 < 20
    assert card["status"] == f"stopped early by EarlyStopping at step 2: {stop.stopping_reason_message}"
    assert "Stopping threshold reached" in card["status"]
    written = path.read_text()
    trainer.validate(module, loader(rows=4))
    with pytest.raises(ValueError, match="no prompts here"):
        trainer.predict(module, loader(rows=4))
    assert path.read_text() == written
