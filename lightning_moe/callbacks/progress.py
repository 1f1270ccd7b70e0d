"""A progress bar that counts optimizer steps, the unit every recipe states its length in.

Lightning's bars count micro-batches against ``max_steps``: with gradient accumulation a 25-step run shows
``50/25``, and ``max_epochs=-1`` (what ``max_steps`` sets) prints as ``Epoch 1/-2``. This bar's training task
is the run's optimizer steps (``max_steps``, or the epochs' steps when only ``max_epochs`` is set), advanced
when ``trainer.global_step`` moves, so the bar, its rate and its remaining time are in steps. Validation,
sanity-check and test bars count their batches as Lightning's do. The loss and the ``perf/*`` values the
callbacks put on the progress bar are shown beside it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar

from lightning_moe.modules.step_metrics import trainer_planned_steps


class StepProgressBar(RichProgressBar):
    """Lightning's rich bar with its training task in optimizer steps (``Step 12/25``) instead of
    micro-batches, kept across epochs; everything else (theme, refresh rate, validation bars) as Lightning's."""

    @property
    def total_train_batches(self) -> float:
        return trainer_planned_steps(self.trainer)

    def _get_train_description(self, current_epoch: int) -> str:
        description = "Step"
        if self.trainer.max_epochs is not None and self.trainer.max_epochs > 1:
            description = f"Epoch {current_epoch + 1}/{self.trainer.max_epochs}"
        return f"{description:{len(self.validation_description)}}"

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # one task for the whole fit: Lightning's reset per epoch would restart a count of steps
        if self.train_progress_bar_id is None:
            super().on_train_epoch_start(trainer, pl_module)
        elif self.progress is not None:
            self.progress.update(self.train_progress_bar_id,
                                 description=self._get_train_description(trainer.current_epoch))
            self.refresh()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()  # resumed mid-epoch
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()
