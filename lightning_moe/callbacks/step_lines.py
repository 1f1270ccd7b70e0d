"""Progress as plain lines, for output that is not a terminal (a Slurm job's log file, a pipe, ``nohup``).

A rich bar redraws itself in place; written to a file it appears once, at the end. This progress "bar" prints
one line every ``log_every_n_steps`` optimizer steps instead, Megatron's iteration line::

    [2026-12-03 17:02:11] Step 10/20 | loss 6.9632 | grad norm 1.104 | lr 2.73e-03 | tokens/s/GPU 3,338 |
    TFLOP/s/GPU 0.0135 | step time 0.614 s | time left 0:00:06 | memory 0.63 GiB

(one line), from the values the module and the :class:`Throughput` / :class:`PeakMemory` callbacks log at that
step, and one line per validation. The CLI picks it when stdout is not a terminal.
"""

from __future__ import annotations

import datetime
import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar

from lightning_moe.modules.step_metrics import trainer_planned_steps

# (logged metric, label, format) in the order of the line
FIELDS = (
    ("train/loss", "loss", ".4f"),
    ("train/grad_norm", "grad norm", ".4g"),
    ("train/lr", "lr", ".3e"),
    ("perf/tokens_per_s_per_gpu", "tokens/s/{unit}", ",.0f"),
    ("perf/tflops_per_gpu", "TFLOP/s/{unit}", ".4g"),
    ("perf/step_time_s", "step time", ".4g"),
)
UNITS = {"perf/step_time_s": " s"}
MEMORY = ("memory/peak_allocated_gib", "memory/peak_rss_gib")


def device_unit(device_type: str) -> str:
    """What a per-device rate is per: a GPU, or on the CPU each process."""
    return "GPU" if device_type == "cuda" else "process"


class StepLines(ProgressBar):
    """One plain progress line every ``log_every_n_steps`` optimizer steps (see the module docstring).

    Args:
        stream: where the lines go (default: stdout).
    """

    def __init__(self, stream: Any = None) -> None:
        super().__init__()
        self.stream = stream
        self._enabled = True
        self._start_time: float | None = None
        self._start_step = 0
        self._last_step = 0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled and (self._trainer is None or self._trainer.is_global_zero)

    def _write(self, text: str) -> None:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        print(f"[{stamp}] {text}", file=self.stream or sys.stdout, flush=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_time = time.monotonic()
        self._start_step = self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # inside an accumulation window
            return
        self._last_step = step
        total = trainer_planned_steps(trainer)
        if self.is_enabled and (step % max(trainer.log_every_n_steps, 1) == 0 or step == total):
            self._write(self.step_line(trainer, pl_module, step, total))

    def step_line(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, total: float) -> str:
        metrics = trainer.callback_metrics
        unit = device_unit(pl_module.device.type)
        parts = [f"Step {step}/{total if total != float('inf') else '?'}"]
        for name, label, spec in FIELDS:
            if name in metrics:
                parts.append(f"{label.format(unit=unit)} {float(metrics[name]):{spec}}{UNITS.get(name, '')}")
        done = step - self._start_step
        if self._start_time is not None and done > 0 and total != float("inf"):
            left = (time.monotonic() - self._start_time) / done * max(total - step, 0)
            parts.append(f"time left {datetime.timedelta(seconds=round(left))}")
        memory = next((metrics[name] for name in MEMORY if name in metrics), None)
        if memory is not None:
            parts.append(f"memory {float(memory):.2f} GiB")
        return " | ".join(parts)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.is_enabled or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        values = [f"{name} {float(value):.4f}" for name, value in sorted(trainer.callback_metrics.items())
                  if name.startswith("val/")]
        self._write(" | ".join([f"Validation at step {trainer.global_step}", *values]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.is_enabled and self._start_time is not None:
            elapsed = datetime.timedelta(seconds=round(time.monotonic() - self._start_time))
            self._write(f"Training ended at step {trainer.global_step} after {elapsed}")
