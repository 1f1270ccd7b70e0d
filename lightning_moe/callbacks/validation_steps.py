"""``trainer.val_check_interval: N`` (an int) in optimizer steps, the unit of ``max_steps``, ``log_every_n_steps``,
the progress bar and every recipe: Lightning counts it in micro-batches, so with gradient accumulation (which the
data modules set from the batch sizes) validation would run every N / accumulation steps."""

from __future__ import annotations

import lightning.pytorch as pl


class ValidationInSteps(pl.Callback):
    """Validate every ``val_check_interval`` optimizer steps when that is an int (a float fraction of an epoch
    and a time interval keep Lightning's meaning); the CLI adds it to every run."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after Lightning set val_check_batch from the interval for this epoch's training loader
        interval = trainer.val_check_interval
        if isinstance(interval, int) and isinstance(trainer.val_check_batch, int):
            trainer.val_check_batch = interval * trainer.accumulate_grad_batches
