"""Test-only callbacks that the fault tests load into a real ``lightning-moe fit`` process (by class path).

``LossLog`` appends each optimizer step's loss to a file as it happens (a process killed with SIGKILL writes no
run card). ``PauseAt`` stops the process at one named point, announces it with a marker file and waits for a
release file (or forever, for a kill): the tests act on files, never on timing.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_moe.callbacks.step_end import StepEndCallback, step_loss


class LossLog(StepEndCallback):
    """One ``step repr(loss)`` line per optimizer step, flushed at once."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        with open(self.path, "a") as f:
            f.write(f"{trainer.global_step} {step_loss(trainer, pl_module, outputs)!r}\n")


class FailAfterFirstStep(StepEndCallback):
    """Raise once the first optimizer step is done (a run that fails mid-training)."""

    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        raise RuntimeError("failing on purpose after step 1")


def pause(marker: str, release: str | None) -> None:
    """Announce the pause, then wait for ``release`` to appear (forever when None: the test kills us)."""
    Path(marker).write_text(str(os.getpid()))
    while release is None or not os.path.exists(release):
        time.sleep(0.01)


class PauseAt(pl.Callback):
    """Pause once, at one of:

    - ``batch``: before micro-batch ``micro`` of optimizer step ``step`` (1-based, the step being computed);
    - ``save_payload``: inside the save of a checkpoint whose name contains ``name``, once its data files are
      written and before its index (DCP ``.metadata``) is;
    - ``save_publish``: inside that save once it is complete, before it is moved to its name;

    on global rank ``rank`` only.
    """

    def __init__(self, point: str, marker: str, release: str | None = None, step: int = 0, micro: int = 0,
                 name: str = "", rank: int = 0) -> None:
        if point not in ("batch", "save_payload", "save_publish"):
            raise ValueError(f"PauseAt: unknown point {point!r}")
        self.point, self.marker, self.release = point, marker, release
        self.step, self.micro, self.name, self.rank = step, micro, name, rank
        self.done = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.global_rank != self.rank:  # only one rank pauses (and is signalled or killed)
            self.done = True
        if self.point == "save_publish":
            from lightning_moe.io import training
            from lightning_moe.parallel import strategy

            original = training.publish
            paused = self._wrap(original, lambda staged, final: Path(final).name)
            for module in (training, strategy):  # whether the strategy imports it at the top or at each call
                if getattr(module, "publish", None) is original:
                    module.publish = paused
        elif self.point == "save_payload":
            from torch.distributed.checkpoint.filesystem import FileSystemWriter

            FileSystemWriter.finish = self._wrap(FileSystemWriter.finish, lambda writer, *a, **k: Path(writer.path).name)

    def _wrap(self, function, name_of):
        @functools.wraps(function)
        def paused(*args, **kwargs):
            if not self.done and self.name in name_of(*args, **kwargs):
                self.done = True
                pause(self.marker, self.release)
            return function(*args, **kwargs)

        return paused

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.point != "batch" or self.done:
            return
        position = batch_idx % trainer.accumulate_grad_batches
        if trainer.global_step + 1 == self.step and position == self.micro:
            self.done = True
            pause(self.marker, self.release)
