"""Peak memory per optimizer step: CUDA allocated and reserved, and the process's resident set (RSS).

CUDA peaks are reset after every step, so each logged value (every ``log_every_n_steps``) is the peak *of that
step*; the run card gets the maximum over all steps and ranks. The process RSS (current, from /proc/self/statm) and its lifetime peak
(``getrusage``'s ``ru_maxrss``) are logged on every device: host memory matters with CPU offload and loaders.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_moe.callbacks.step_end import StepEndCallback, log_host, max_over_ranks
from lightning_moe.modules.step_metrics import logging_step

GIB = 1024**3


def current_rss_bytes() -> int | None:
    """Resident set size of this process now (Linux), else None."""
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except OSError:
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Highest resident set size of this process so far (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class PeakMemory(StepEndCallback):
    """Logs ``memory/*`` in GiB at every optimizer step and keeps the run's peaks for the run card."""

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.device = pl_module.device
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> dict[str, float]:
        """This step's readings in GiB."""
        values = {"peak_rss_gib": peak_rss_bytes() / GIB}
        rss = current_rss_bytes()
        if rss is not None:
            values["rss_gib"] = rss / GIB
        if self.device.type == "cuda":
            values["peak_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / GIB
            values["peak_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / GIB
            torch.cuda.reset_peak_memory_stats(self.device)
        return values

    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        # host readings (the allocator's counters, /proc), logged at logging steps
        log = logging_step(trainer)
        for name, value in self.read().items():
            self.peaks[name] = max(value, self.peaks.get(name, 0.0))
            if log:
                log_host(pl_module, f"memory/{name}", value)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # every rank gets here: the card reports the largest rank
        names = sorted(self.peaks)
        if names:
            values = torch.tensor([self.peaks[n] for n in names], dtype=torch.float64, device=pl_module.device)
            self.peaks = dict(zip(names, max_over_ranks(values).tolist()))

    def summary(self) -> dict[str, float | None]:
        keys = ("peak_allocated_gib", "peak_reserved_gib", "peak_rss_gib")
        return {key: self.peaks.get(key) for key in keys}
