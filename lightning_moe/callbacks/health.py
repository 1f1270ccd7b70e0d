"""Non-finite loss or gradients: skip the update or stop the run, and count it.

Gradients are checked in ``on_before_optimizer_step`` (after backward, before clipping and the update): each
rank checks its local gradient shards, then the flag is all-reduced (MAX) so every rank takes the same
decision: the step's one read of the device. A non-finite loss gives non-finite gradients, so it is caught there
too; the step's reported loss is checked again when it is read back (at the step's end, or with the other steps'
at a logging step), for the count and for ``stop``.

A skipped step is a true skip: every gradient is set to None, so AdamW leaves those parameters and their
moments untouched (no moment update, no weight decay, no step count). ``global_step`` and the learning-rate
schedule still advance, as in Megatron.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.tensor import DTensor

from lightning_moe.callbacks.step_end import (
    StepEndCallback,
    is_finite,
    log_host,
    max_over_ranks,
    reports_on_read,
    step_loss,
)
from lightning_moe.modules.step_metrics import logging_step


def has_nonfinite_gradient(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """A 0-d bool tensor: some gradient held by this rank has a NaN or an inf."""
    flags = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            flags.append(torch.logical_not(torch.isfinite(local).all()))
    if not flags:
        return torch.zeros((), dtype=torch.bool)
    device = flags[0].device
    return torch.stack([f.to(device) for f in flags]).any()


class HealthCheck(StepEndCallback):
    """Args:
    action: ``skip`` drops the step's update and goes on; ``stop`` drops it and ends the run after the step.
    max_skipped_steps: with ``skip``, end the run once more steps than this were skipped (None: never).
    """

    def __init__(self, action: Literal["skip", "stop"] = "skip", max_skipped_steps: int | None = None) -> None:
        if action not in ("skip", "stop"):
            raise ValueError(f"HealthCheck(action={action!r}): expected 'skip' or 'stop'")
        self.action = action
        self.max_skipped_steps = max_skipped_steps
        self.skipped_steps: list[int] = []
        self.nan_steps: list[int] = []
        self.stopped_at: int | None = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        bad = has_nonfinite_gradient(optimizer).to(device=pl_module.device, dtype=torch.float32)
        if not bool(max_over_ranks(bad.reshape(1))):
            return
        step = trainer.global_step + 1  # the step being taken
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None
        self.skipped_steps.append(step)
        self._record_nan(trainer, step, "gradients; update skipped")

    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        if not reports_on_read(pl_module):
            self._check_loss(trainer, trainer.global_step, step_loss(trainer, pl_module, outputs))
        if logging_step(trainer):
            log_host(pl_module, "train/skipped_steps", len(self.skipped_steps))
            log_host(pl_module, "train/nan_steps", len(self.nan_steps))

    def on_steps_read(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stats: list) -> None:
        for step in stats:
            self._check_loss(trainer, step.step, step.loss)

    def _check_loss(self, trainer: pl.Trainer, step: int, loss: float | None) -> None:
        if not is_finite(loss) and step not in self.nan_steps:
            self._record_nan(trainer, step, f"loss ({loss}) with finite gradients; update applied")

    def _record_nan(self, trainer: pl.Trainer, step: int, what: str) -> None:
        self.nan_steps.append(step)
        too_many = self.max_skipped_steps is not None and len(self.skipped_steps) > self.max_skipped_steps
        if self.action == "stop" or too_many:
            reason = "HealthCheck(action='stop')" if self.action == "stop" else (
                f"{len(self.skipped_steps)} skipped steps > max_skipped_steps={self.max_skipped_steps}"
            )
            rank_zero_warn(f"step {step}: non-finite {what}; stopping the run ({reason})")
            trainer.should_stop = True
            self.stopped_at = step
        else:
            rank_zero_warn(f"step {step}: non-finite {what} ({len(self.skipped_steps)} steps skipped so far)")

    def summary(self) -> dict[str, Any]:
        return {
            "skipped_steps": len(self.skipped_steps),
            "nan_steps": len(self.nan_steps),
            "skipped_step_numbers": self.skipped_steps,
            "nan_step_numbers": self.nan_steps,
        }
