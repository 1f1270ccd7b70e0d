"""Throughput in a real Lightning run: step times against the clock the steps advance, tokens against the data fed in,
FLOPs against the model-FLOPs formula on the very batches, MFU against the given peak."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from tiny_lm import MICRO_BATCH, SEQ, PackedRows, TinyLM, loader, make_trainer, tiny_config

from lightning_moe.callbacks import Throughput
from lightning_moe.callbacks.peak_flops import PEAK_FLOPS, cpu_peak_flops, lookup_peak_flops
from lightning_moe.models.flops import batch_flops


class FakeClock:
    """The clock the Throughput callback reads (its module's ``time``), advanced only by the steps' ``sleep``: the
    intervals it measures are then exact sums of the sleeps, whatever else the machine is doing."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    from lightning_moe.callbacks import throughput

    fake = FakeClock()
    monkeypatch.setattr(throughput, "time", fake)
    return fake


class WallClock(pl.Callback):
    """Clock time from the first micro-batch to the last step's end, and the validation runs in between."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.start = self.end = None
        self.validations: list[tuple[float, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start = self.start or self.clock.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.end = self.clock.perf_counter()

    def on_validation_start(self, trainer, pl_module):
        self._val = self.clock.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        self.validations.append((self._val, self.clock.perf_counter()))

    def validating(self) -> float:
        return sum(end - start for start, end in self.validations if end <= self.end)


class SlowSteps(TinyLM):
    """Micro-batches that take 20 ms of the fake clock each, validation batches 200 ms."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock

    def training_step(self, batch, batch_idx):
        self.clock.sleep(0.02)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.clock.sleep(0.2)


def logged_rows(trainer) -> list[dict[str, str]]:
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        return list(csv.DictReader(f))


def test_throughput_counts_steps_tokens_and_flops(tmp_path, clock):
    accumulate, steps = 2, 5
    throughput = Throughput(window=3, warmup_steps=1, peak_flops=2e12)
    wall = WallClock(clock)  # after Throughput: its step end is timed after Throughput's
    trainer = make_trainer(tmp_path, [throughput, wall], max_steps=steps, accumulate_grad_batches=accumulate)
    trainer.fit(SlowSteps(clock), loader())

    history = throughput.history.values()
    assert [s.step for s in history] == list(range(1, steps + 1))
    # the intervals tile the time of training: each step is its micro-batches' 2 x 20 ms
    assert [s.step_time_s for s in history] == pytest.approx([accumulate * 0.02] * steps)
    assert sum(s.step_time_s for s in history) == pytest.approx(wall.end - wall.start)

    data = PackedRows()
    per_step = MICRO_BATCH * accumulate
    for s in history:
        rows = slice((s.step - 1) * per_step, s.step * per_step)
        assert s.tokens == per_step * SEQ
        assert s.label_tokens == int((data.labels[rows] != -100).sum())
        micro = [slice(r, r + MICRO_BATCH) for r in range(rows.start, rows.stop, MICRO_BATCH)]
        expected = sum(batch_flops(tiny_config(), data.position_ids[m], data.labels[m]) for m in micro)
        assert s.flops == pytest.approx(expected)

    summary = throughput.summary()
    averaged = history[-3:]
    mean_time = sum(s.step_time_s for s in averaged) / 3
    assert summary["averaged_steps"] == 3
    assert summary["step_time_s"] == pytest.approx(mean_time)
    assert summary["tokens_per_s_per_gpu"] == pytest.approx(per_step * SEQ / mean_time)
    flops_per_s = sum(s.flops for s in averaged) / 3 / mean_time
    assert summary["tflops_per_gpu"] == pytest.approx(flops_per_s / 1e12)
    assert summary["mfu"] == pytest.approx(flops_per_s / 2e12)

    # the progress bar shows step time and tokens/s/GPU; the logger gets every perf/* figure
    assert {"perf/step_time_s", "perf/tokens_per_s_per_gpu"} <= set(trainer.progress_bar_metrics)
    rows = [r for r in logged_rows(trainer) if r.get("perf/tflops_per_gpu")]
    assert len(rows) == steps
    assert float(rows[-1]["perf/step_time_s"]) == pytest.approx(mean_time)


def test_throughput_excludes_validation_and_measures_the_cpu_peak(tmp_path, clock):
    throughput, wall = Throughput(window=10), WallClock(clock)
    trainer = make_trainer(tmp_path, [throughput, wall], max_steps=4, val_check_interval=2,
                           limit_val_batches=2, check_val_every_n_epoch=None)
    trainer.fit(SlowSteps(clock), loader(), loader(rows=4, seed=1))
    # validation (2 x 200 ms) after steps 2 and 4; the second one comes after the last step
    assert len(wall.validations) == 2 and wall.validating() == pytest.approx(0.4)
    assert [s.step_time_s for s in throughput.history.values()] == pytest.approx([0.02] * 4)
    total = sum(s.step_time_s for s in throughput.history.values())
    assert total == pytest.approx(wall.end - wall.start - wall.validating())
    summary = throughput.summary()
    assert summary["device"] == "cpu" and summary["peak_flops_source"].startswith("measured")
    assert summary["peak_flops_per_gpu"] == cpu_peak_flops(torch.float32)[0]
    assert summary["mfu"] == pytest.approx(summary["tflops_per_gpu"] * 1e12 / summary["peak_flops_per_gpu"])


def test_models_without_a_model_config_count_six_flops_per_parameter_and_token(tmp_path):
    class Plain(TinyLM):
        def __init__(self):
            super().__init__()
            # like a transformers model: a config object, but not a ModelConfig
            self.model.config = SimpleNamespace(**self.model.config.to_dict())

    throughput = Throughput()
    make_trainer(tmp_path, [throughput], max_steps=2).fit(Plain(), loader())
    params = sum(p.numel() for p in TinyLM().parameters())
    assert throughput.history.values()[0].flops == pytest.approx(6 * params * MICRO_BATCH * SEQ)
    assert "6 x parameters" in throughput.summary()["flops_method"]


def test_peak_flops_table_and_overrides():
    assert lookup_peak_flops("NVIDIA H200", "bf16") == 989e12
    assert lookup_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert lookup_peak_flops("NVIDIA H100 80GB HBM3", "fp8") == 1979e12
    assert lookup_peak_flops("NVIDIA B200", "bf16") == 2.25e15
    assert lookup_peak_flops("NVIDIA GB200", "bf16") == 2.5e15
    assert lookup_peak_flops("NVIDIA GB200", "mxfp8") == 5e15
    assert lookup_peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert lookup_peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None  # Ampere has no FP8
    assert lookup_peak_flops("NVIDIA H100 PCIe", "bf16") < lookup_peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert lookup_peak_flops("cpu", "bf16") is None
    assert lookup_peak_flops("NVIDIA H200", "bf16", {"H200": 1.0e15}) == 1.0e15
    assert lookup_peak_flops("cpu", "tf32", {"cpu": 2e12}) == 2e12
    hopper_blackwell = [name for name in PEAK_FLOPS if name[0] in "HBG"]
    assert all(PEAK_FLOPS[n]["fp8"] == pytest.approx(2 * PEAK_FLOPS[n]["bf16"], rel=1e-3) for n in hopper_blackwell)


def test_throughput_rejects_bad_settings():
    with pytest.raises(ValueError, match="window"):
        Throughput(window=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        Throughput(warmup_steps=-1)
