"""What a run prints: the progress bar counts optimizer steps (with and without accumulation, in every recipe),
the model summary states the package's FLOPs instead of Lightning's zero, and the CPU peak behind MFU is
measured once and cached."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from tiny_lm import TinyLM, loader, make_trainer, tiny_config

from lightning_moe.callbacks import peak_flops
from lightning_moe.callbacks.progress import StepProgressBar
from lightning_moe.callbacks.summary import ModelSummary
from lightning_moe.cli import replace_lightning_defaults
from lightning_moe.models.flops import flops_per_token
from lightning_moe.modules.step_metrics import planned_optimizer_steps

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class RecordingBar(StepProgressBar):
    """Records (description, completed, total) of the training task after every micro-batch."""

    def __init__(self) -> None:
        super().__init__(console_kwargs={"force_terminal": False, "file": open("/dev/null", "w")})
        self.seen: list[tuple[str, float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        task = self.progress.tasks[self.train_progress_bar_id]
        self.seen.append((task.description, task.completed, task.total))


@pytest.mark.parametrize(("max_steps", "max_epochs", "accumulate"), [(5, None, 4), (-1, 2, 3)])
def test_the_bar_counts_optimizer_steps(tmp_path, max_steps, max_epochs, accumulate):
    bar = RecordingBar()
    trainer = make_trainer(tmp_path, [bar], max_steps=max_steps, max_epochs=max_epochs,
                           accumulate_grad_batches=accumulate, enable_progress_bar=True)
    rows = 16  # 8 micro-batches per epoch
    trainer.fit(TinyLM(), loader(rows=rows))
    expected = max_steps if max_steps > 0 else max_epochs * math.ceil(rows / 2 / accumulate)
    assert trainer.global_step == expected
    assert {total for _, _, total in bar.seen} == {expected}
    completed = [done for _, done, _ in bar.seen]
    assert completed == sorted(completed) and completed[-1] == expected and max(completed) <= expected
    # a step is counted when its accumulation window closes, not per micro-batch
    assert completed[: accumulate] == [0] * (accumulate - 1) + [1]
    descriptions = {text.strip() for text, _, _ in bar.seen}
    assert descriptions <= {"Step", f"Epoch 1/{max_epochs}", f"Epoch 2/{max_epochs}"}
    assert not any("-" in text for text in descriptions)


def recipe_trainers() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(CONFIGS.rglob("*.yaml")):
        config = yaml.safe_load(path.read_text()) or {}
        if "trainer" in config:
            found.append((str(path.relative_to(CONFIGS)), config["trainer"]))
    return found


def test_every_recipe_has_a_finite_positive_progress_total():
    trainers = recipe_trainers()
    assert len(trainers) > 30
    for name, trainer in trainers:
        total = planned_optimizer_steps(trainer.get("max_steps", -1), trainer.get("max_epochs"),
                                        batches_per_epoch=1000, accumulate_grad_batches=8)
        assert math.isfinite(total) and total > 0 and total == int(total), name


def test_the_summary_prints_model_flops_not_lightnings_zero(tmp_path):
    module = TinyLM()
    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("rich.get_console", lambda: console)
        trainer = make_trainer(tmp_path, [ModelSummary(max_depth=1)], max_steps=1, enable_model_summary=True)
        trainer.fit(module, loader(rows=4))
    text = console.export_text()
    assert "FLOPs: 0" not in text and "Total FLOPs" not in text
    per_token = flops_per_token(tiny_config(), None)
    assert f"Model FLOPs per token (training, model config): {per_token:.4g}" in text
    assert "Decoder" in text  # the layer table is still there


def test_the_cli_swaps_lightnings_default_bar_and_summary():
    from lightning.pytorch.callbacks import RichModelSummary, RichProgressBar, TQDMProgressBar

    callbacks = replace_lightning_defaults([RichProgressBar(refresh_rate=3), RichModelSummary(max_depth=2)])
    assert [type(c) for c in callbacks] == [StepProgressBar, ModelSummary]
    assert callbacks[0].refresh_rate == 3 and callbacks[1]._max_depth == 2
    chosen = TQDMProgressBar()  # a bar the recipe chose itself stays
    assert replace_lightning_defaults([chosen]) == [chosen]


def test_the_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_MOE_CACHE", str(tmp_path))
    calls = []

    def measure(dtype, size=peak_flops.CPU_PEAK_SIZE, repeats=3):
        calls.append(dtype)
        return 50.0e9 * len(calls)

    monkeypatch.setattr(peak_flops, "measure_cpu_peak_flops", measure)
    first, source = peak_flops.cpu_peak_flops(torch.float32)
    again, _ = peak_flops.cpu_peak_flops(torch.float32)
    assert calls == [torch.float32] and first == again and str(tmp_path) in source
    cached = json.loads((tmp_path / peak_flops.CPU_PEAK_CACHE).read_text())
    assert cached == {peak_flops.cpu_identity(torch.float32): first}
    peak_flops.cpu_peak_flops(torch.bfloat16)  # another dtype is another entry
    assert calls == [torch.float32, torch.bfloat16]
    # a pinned figure in the cache wins over measuring
    cached[peak_flops.cpu_identity(torch.float32)] = 123.0e9
    (tmp_path / peak_flops.CPU_PEAK_CACHE).write_text(json.dumps(cached))
    assert peak_flops.cpu_peak_flops(torch.float32)[0] == 123.0e9
    (tmp_path / peak_flops.CPU_PEAK_CACHE).write_text("{not json")
    with pytest.raises(ValueError, match=peak_flops.CPU_PEAK_CACHE):
        peak_flops.cpu_peak_flops(torch.float32)


def test_the_real_measurement_is_a_plausible_rate():
    rate = peak_flops.measure_cpu_peak_flops(torch.float32, size=256, repeats=2)
    assert 1e8 < rate < 1e14


def test_validation_runs_every_val_check_interval_optimizer_steps(tmp_path):
    """With 3 micro-batches per optimizer step, ``val_check_interval: 2`` validates after steps 2, 4 and 6 (Lightning
    alone: every 2 micro-batches), the steps the bar and the loggers count."""
    from lightning_moe.callbacks import ValidationInSteps

    class Validated(TinyLM):
        def validation_step(self, batch, batch_idx):
            self.validated_at.append(self.trainer.global_step)

    module = Validated()
    module.validated_at = []
    trainer = make_trainer(tmp_path, [ValidationInSteps()], max_steps=6, accumulate_grad_batches=3,
                           val_check_interval=2, limit_val_batches=1)
    trainer.fit(module, loader(rows=64), loader(rows=2))
    assert module.validated_at == [2, 4, 6]


def test_off_a_terminal_the_cli_prints_step_lines(tmp_path):
    """A plain line every log_every_n_steps optimizer steps (and at the last), with the values logged at that step."""
    import io

    from lightning_moe.callbacks import StepLines, Throughput

    stream = io.StringIO()
    trainer = make_trainer(tmp_path, [Throughput(), StepLines(stream)], max_steps=5, accumulate_grad_batches=2,
                           enable_progress_bar=True, log_every_n_steps=2)
    trainer.fit(TinyLM(), loader())
    lines = stream.getvalue().splitlines()
    steps = [line.split("] Step ")[1].split(" |")[0] for line in lines if "] Step " in line]
    assert steps == ["2/5", "4/5", "5/5"]
    step_time = float(trainer.callback_metrics["perf/step_time_s"])
    assert f"step time {step_time:.4g} s" in lines[-2]  # the last step's own value, not the previous step's
    assert lines[-1].split("] ")[1].startswith("Training ended at step 5")
    from lightning.pytorch.callbacks import RichProgressBar

    from lightning_moe.callbacks import Preemption

    replaced = replace_lightning_defaults([RichProgressBar(), Throughput(), Preemption()], terminal=False)
    # after the callbacks whose values it prints, before the one that can end the run at a step's end
    assert [type(c).__name__ for c in replaced] == ["Throughput", "StepLines", "Preemption"]
