"""The end of an optimizer step, as callbacks see it.

With gradient accumulation several ``on_train_batch_end`` calls make one optimizer step; the step is over
at the first of them after which ``trainer.global_step`` has advanced.

A module that keeps its step values on the device (``CausalLM``: ``step_metrics``) reads them back only at logging
steps and hands callbacks the :class:`StepStats` of every step since the last read through their
``on_steps_read(trainer, pl_module, stats)``; a module that reports on the host every step sets ``step_stats``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_moe.modules.step_metrics import StepMetrics
from lightning_moe.modules.step_stats import StepStats


class StepEndCallback(pl.Callback):
    """Calls :meth:`on_step_end` once per optimizer step. Subclasses that override ``on_train_start`` or
    ``on_train_batch_end`` call ``super()``."""

    _last_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_step > self._last_step:
            self._last_step = trainer.global_step
            self.on_step_end(trainer, pl_module, outputs)

    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        """``outputs``: what ``training_step`` returned for the step's last micro-batch."""


def reports_on_read(pl_module: pl.LightningModule) -> bool:
    """The module hands its steps' figures over at logging steps (``on_steps_read``), not every step."""
    return isinstance(getattr(pl_module, "step_metrics", None), StepMetrics)


def log_host(pl_module: pl.LightningModule, name: str, value: float, **kwargs: Any) -> None:
    """Log a host number as a host tensor: Lightning logs a float as a tensor on the module's device, which its
    logging and progress bar then read back (a host sync on a GPU)."""
    pl_module.log(name, torch.tensor(float(value), dtype=torch.get_default_dtype()), on_step=True, on_epoch=False,
                  batch_size=1, **kwargs)


def step_stats(trainer: pl.Trainer, pl_module: pl.LightningModule) -> StepStats | None:
    """The module's report of the step that just ended, if it writes one (see ``StepStats``)."""
    stats = getattr(pl_module, "step_stats", None)
    return stats if isinstance(stats, StepStats) and stats.step == trainer.global_step else None


def step_loss(trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> float | None:
    """The step's global mean loss from ``StepStats``, else the last micro-batch's returned loss."""
    stats = step_stats(trainer, pl_module)
    if stats is not None:
        return float(stats.loss)
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        return None
    # automatic optimization hands callbacks the loss divided by the accumulation factor
    scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
    return float(loss.detach()) * scale


def is_finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


def data_parallel_size(trainer: pl.Trainer) -> int:
    """Ranks holding different data; TP/CP/EP peers share a batch (see ``ParallelStrategy``)."""
    return int(getattr(trainer.strategy, "data_parallel_size", trainer.world_size))


def max_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum over every rank (a no-op in a single process)."""
    return _all_reduce(values, torch.distributed.ReduceOp.MAX)


def sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """Elementwise sum over every rank (a no-op in a single process)."""
    return _all_reduce(values, torch.distributed.ReduceOp.SUM)


def _all_reduce(values: torch.Tensor, op) -> torch.Tensor:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(values, op=op)
    return values


class StepSeries:
    """Per-step values, thinned to every 2nd, 4th, ... step whenever more than ``limit`` are held, so a long
    run keeps an evenly spaced series of bounded size (always including step multiples of the stride)."""

    def __init__(self, limit: int = 5000) -> None:
        self.limit = limit
        self.stride = 1
        self.by_step: dict[int, Any] = {}

    def add(self, step: int, value: Any) -> None:
        if step % self.stride:
            return
        self.by_step[step] = value
        if len(self.by_step) > self.limit:
            self.stride *= 2
            self.by_step = {s: v for s, v in self.by_step.items() if s % self.stride == 0}

    def values(self) -> list[Any]:
        return list(self.by_step.values())
