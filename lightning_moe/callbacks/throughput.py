"""Training speed per optimizer step: step time, tokens/s (per GPU), model TFLOP/s per GPU and MFU.

Written for this package because Lightning's ``ThroughputMonitor`` cannot take the device peak, knows no
H200, and counts FLOPs per sample instead of from the real packed sequence lengths.

- Step time: from the end of one optimizer step to the end of the next (the first step from its first
  micro-batch), validation excluded. Data loading and checkpoint writes that fall between steps count.
- Tokens: all tokens of the global batch, padding included, and the label tokens, counted on each rank's
  micro-batches (from their host layouts) and summed over the data-parallel ranks.
- Model FLOPs: :mod:`lightning_moe.models.flops` on every micro-batch each rank sees (its real packed lengths
  and label tokens, from the batch's host layout), summed over the data-parallel ranks (packed rows make them
  differ): once per logging step for all the steps since the last one, so no step waits for the device.
  Transformers models of the generic path count as their native family's ``ModelConfig`` where one maps
  the config, else by ``FlopCounterMode`` on a fake-tensor step once (:mod:`lightning_moe.models.hf_flops`);
  other models without a ``ModelConfig`` count 6 x parameters per token.
- Per GPU: divided by the world size (TP, CP and EP peers included). MFU: per-GPU FLOP/s / device peak.

Logged values (every ``log_every_n_steps``) are averages over the last ``window`` steps after ``warmup_steps``;
per-step values are kept in :attr:`Throughput.history` for the run card (thinned evenly in long runs).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_moe.callbacks.peak_flops import cpu_peak_flops, lookup_peak_flops, matmul_precision
from lightning_moe.callbacks.step_end import (
    StepEndCallback,
    StepSeries,
    data_parallel_size,
    log_host,
    sum_over_ranks,
)
from lightning_moe.models.batch_layout import BatchLayout
from lightning_moe.models.config import ModelConfig
from lightning_moe.models.flops import layout_flops, parameter_flops_per_token
from lightning_moe.models.hf import HFModel
from lightning_moe.models.hf_flops import COUNTED_METHOD, CountedFlops, native_model_config
from lightning_moe.modules.step_metrics import logging_step

RATE_NAMES = ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "label_tokens_per_s_per_gpu",
              "tflops_per_gpu", "mfu")


@dataclass
class StepSpeed:
    step: int
    step_time_s: float
    tokens: int
    label_tokens: int
    flops: float  # model FLOPs of the global batch
    samples: int = 0  # samples of the global batch, for modules that name their unit (images)
    sample_unit: str | None = None

    def rates(self, world_size: int, peak_flops: float | None) -> dict[str, float | None]:
        flops_per_gpu = self.flops / self.step_time_s / world_size
        per_sample = {f"{self.sample_unit}_per_s_per_gpu": self.samples / self.step_time_s / world_size
                      } if self.sample_unit else {}
        return {**per_sample,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens / self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens / self.step_time_s / world_size,
            "label_tokens_per_s_per_gpu": self.label_tokens / self.step_time_s / world_size,
            "tflops_per_gpu": flops_per_gpu / 1e12,
            "mfu": flops_per_gpu / peak_flops if peak_flops else None,
        }


def window_speed(steps: list[StepSpeed]) -> StepSpeed:
    """Steps pooled: mean step time, mean tokens and FLOPs per step."""
    n = len(steps)
    return StepSpeed(
        step=steps[-1].step,
        step_time_s=sum(s.step_time_s for s in steps) / n,
        tokens=round(sum(s.tokens for s in steps) / n),
        label_tokens=round(sum(s.label_tokens for s in steps) / n),
        flops=sum(s.flops for s in steps) / n,
        samples=round(sum(s.samples for s in steps) / n),
        sample_unit=steps[-1].sample_unit,
    )


class Throughput(StepEndCallback):
    """Logs ``perf/*`` at every logging step; step time and tokens/s/GPU also go to the progress bar.

    Args:
        window: steps averaged in the logged values and the run card (the last N).
        warmup_steps: first steps of the run left out of the averages (benchmarks: compile, allocator warmup).
        peak_flops: the device's peak FLOP/s (a number), or ``{device-name fragment: FLOP/s}`` entries that
            take precedence over the built-in table. Without it, a CPU's peak is measured once per machine
            (:func:`~lightning_moe.callbacks.peak_flops.cpu_peak_flops`) and MFU is None on other devices
            the table lacks.
        peak_precision: the table column, ``bf16`` | ``fp8`` | ``mxfp8`` | ``tf32``; default from the
            trainer's precision (FP8 training converts the model, so say ``fp8`` / ``mxfp8`` here).
    """

    def __init__(self, window: int = 10, warmup_steps: int = 0, peak_flops: float | dict[str, float] | None = None,
                 peak_precision: str | None = None) -> None:
        if window < 1:
            raise ValueError(f"Throughput(window={window}): needs at least 1 step")
        if warmup_steps < 0:
            raise ValueError(f"Throughput(warmup_steps={warmup_steps}): must be >= 0")
        self.window = window
        self.warmup_steps = warmup_steps
        self.peak_flops_setting = peak_flops
        self.peak_precision = peak_precision
        self.history = StepSeries()
        self._recent: deque[StepSpeed] = deque(maxlen=window)
        # refined in on_train_start; these stand if the run fails before it
        self.config: ModelConfig | None = None
        self.trainable_fraction = 1.0
        self.flops_method = None
        self.counted_flops = None
        self.world_size = self.data_parallel_size = 1
        self.device_name = None
        self.precision = peak_precision
        self.peak_flops = float(peak_flops) if isinstance(peak_flops, (int, float)) else None
        self.peak_flops_source = "set in the recipe" if self.peak_flops is not None else None
        self._steps_run = 0
        self._step_start: float | None = None
        self._validation_start: float | None = None
        # (step, seconds, local [FLOPs, label tokens, tokens, samples]) of steps not yet summed over the ranks
        self._unsummed: list[tuple[int, float, list[float]]] = []
        self.device = torch.device("cpu")
        self._reset_step()

    # ------------------------------------------------------------------ setup
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        model = getattr(pl_module, "model", None)
        config = getattr(model, "config", None)
        self.config = config if isinstance(config, ModelConfig) else None
        self.counted_flops = None
        params = list(pl_module.parameters())
        total = sum(p.numel() for p in params)
        self.trainable_fraction = sum(p.numel() for p in params if p.requires_grad) / max(total, 1)
        self.flops_per_param_token = parameter_flops_per_token(total, self.trainable_fraction)
        self.flops_method = (
            "lightning_moe.models.flops (model config, real packed lengths)" if self.config is not None
            else "6 x parameters per token (the model has no ModelConfig)"
        )
        if self.config is None and isinstance(model, HFModel):
            self.config = native_model_config(model.config)
            if self.config is not None:
                self.flops_method = ("lightning_moe.models.flops (the native family's ModelConfig of the "
                                     "transformers config, real packed lengths)")
            else:
                self.counted_flops = CountedFlops(model.hf_class, model.config)
                self.flops_method = COUNTED_METHOD
        # a module that counts its own micro-batches (throughput_counts: images, tokens, label tokens, FLOPs)
        self.module_counts = getattr(pl_module, "throughput_counts", None)
        self.sample_unit = getattr(pl_module, "throughput_unit", None) if self.module_counts else None
        if self.module_counts is not None:
            self.flops_method = f"{type(pl_module).__name__}.throughput_counts (the model's own FLOP count)"
        self.world_size = trainer.world_size
        self.data_parallel_size = data_parallel_size(trainer)
        device = pl_module.device
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        self.precision = self.peak_precision or matmul_precision(str(trainer.precision))
        self.peak_flops_source = "set in the recipe"
        if not isinstance(self.peak_flops_setting, (int, float)):
            self.peak_flops = lookup_peak_flops(self.device_name, self.precision, self.peak_flops_setting)
            self.peak_flops_source = "datasheet table" if self.peak_flops is not None else None
            if self.peak_flops is None and device.type == "cpu":
                dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
                self.peak_flops, self.peak_flops_source = cpu_peak_flops(dtype)
        self._steps_run = 0
        self._step_start = None
        self._unsummed = []
        self.device = device
        self._reset_step()

    def _reset_step(self) -> None:
        self._tokens = 0
        self._counted: list[tuple[int, int, int, float]] = []  # the module's own counts of its micro-batches
        # the step's micro-batches: their host layouts, else (position ids, labels) read back once per step
        self._micro_batches: list[BatchLayout | tuple[torch.Tensor, torch.Tensor | None]] = []

    def _step_counts(self) -> tuple[float, int]:
        """FLOPs and label tokens of this rank's micro-batches of the step."""
        flops = sum(c[3] for c in self._counted)
        label_tokens = sum(c[2] for c in self._counted)
        for micro_batch in self._micro_batches:
            if isinstance(micro_batch, BatchLayout):
                layout = micro_batch
            else:
                position_ids, labels = micro_batch
                layout = BatchLayout(position_ids.cpu().numpy(), None if labels is None else labels.cpu().numpy())
            if layout.labels is not None:
                label_tokens += layout.label_tokens()
            if self.counted_flops is not None:
                try:
                    flops += self.counted_flops.batch_flops(layout.position_ids, self.trainable_fraction)
                    continue
                except Exception as error:  # noqa: BLE001  (a model the fake step cannot run: said in the run card)
                    self.counted_flops = None
                    self.flops_method = (f"6 x parameters per token (the fake-tensor FLOP count of "
                                         f"the transformers model failed: {error})")
            if self.config is None:
                flops += self.flops_per_param_token * layout.position_ids.size
            else:
                flops += layout_flops(self.config, layout, self.trainable_fraction)
        return flops, label_tokens

    # ------------------------------------------------------------------ timing
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._step_start is None:
            self._step_start = time.perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validation_start is not None and self._step_start is not None:
            self._step_start += time.perf_counter() - self._validation_start
        self._validation_start = None

    # ------------------------------------------------------------------ counting
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if getattr(self, "module_counts", None) is not None:
            counts = self.module_counts(batch)
            self._counted.append(counts)
            self._tokens += counts[1]
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise ValueError("Throughput: batches must be dicts with 'input_ids' (and 'position_ids', 'labels')")
        input_ids = batch["input_ids"]
        self._tokens += input_ids.numel()
        if isinstance(batch.get("layout"), BatchLayout):
            self._micro_batches.append(batch["layout"])
        else:
            position_ids = batch.get("position_ids")
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            self._micro_batches.append((position_ids, batch.get("labels")))
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        now = time.perf_counter()
        samples = sum(c[0] for c in self._counted)
        flops, label_tokens = self._step_counts()
        self._unsummed.append((trainer.global_step, max(now - self._step_start, 1e-9),
                               [flops, label_tokens, self._tokens, samples]))
        self._step_start = now
        self._reset_step()
        if logging_step(trainer):
            self._add_steps()
            self._log(pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._add_steps()  # the steps after the last logging step, for the run card

    def _add_steps(self) -> None:
        """The steps counted since the last call, summed over the ranks (one all-reduce for all of them) and added
        to the history and the window."""
        if not self._unsummed:
            return
        counts = [c for _, _, c in self._unsummed]
        if self.world_size > 1:
            # each rank counted its data-parallel batch, which its tensor/context-parallel peers counted too
            local = torch.tensor(counts, dtype=torch.float64, device=self.device)
            counts = (sum_over_ranks(local) * self.data_parallel_size / self.world_size).tolist()
        for (step, seconds, _), (flops, label_tokens, tokens, samples) in zip(self._unsummed, counts):
            speed = StepSpeed(step=step, step_time_s=seconds, tokens=round(tokens), label_tokens=round(label_tokens),
                              flops=flops, samples=round(samples), sample_unit=getattr(self, "sample_unit", None))
            self._steps_run += 1
            self.history.add(speed.step, speed)
            if self._steps_run > self.warmup_steps:
                self._recent.append(speed)
        self._unsummed = []

    def _log(self, pl_module: pl.LightningModule) -> None:
        pooled = window_speed(list(self._recent)) if self._recent else self.history.values()[-1]
        for name, value in pooled.rates(self.world_size, self.peak_flops).items():
            if value is not None:
                log_host(pl_module, f"perf/{name}", value, prog_bar=name in ("step_time_s", "tokens_per_s_per_gpu"))

    # ------------------------------------------------------------------ run card
    def summary(self) -> dict[str, Any]:
        """Averages over the last ``window`` steps after warmup (None before any), and how they were made."""
        rates = (
            window_speed(list(self._recent)).rates(self.world_size, self.peak_flops) if self._recent
            else dict.fromkeys(RATE_NAMES)
        )
        return {
            **rates,
            "averaged_steps": len(self._recent),
            "warmup_steps": self.warmup_steps,
            "device": self.device_name,
            "peak_flops_per_gpu": self.peak_flops,
            "peak_flops_source": self.peak_flops_source,
            "peak_precision": self.precision,
            "flops_method": self.flops_method,
            "trainable_fraction": self.trainable_fraction,
        }

    def series(self) -> list[dict[str, Any]]:
        """Every step of this run: its own time, tokens, FLOPs and rates (not averaged)."""
        return [{**asdict(s), **s.rates(self.world_size, self.peak_flops)} for s in self.history.values()]
