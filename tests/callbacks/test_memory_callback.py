"""PeakMemory on the CPU: its RSS readings against psutil, and a real allocation showing up in the logs."""

from __future__ import annotations

import csv

import psutil
import pytest
import torch
from tiny_lm import TinyLM, loader, make_trainer

from lightning_moe.callbacks import PeakMemory
from lightning_moe.callbacks.memory import GIB, current_rss_bytes, peak_rss_bytes

BALLAST_BYTES = 256 * 1024**2


class Ballast(TinyLM):
    """Holds 256 MiB of touched memory from step 3 on."""

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 2 and not hasattr(self, "ballast"):
            self.ballast = torch.ones(BALLAST_BYTES // 4)
        return super().training_step(batch, batch_idx)


def test_rss_readings_agree_with_psutil():
    process = psutil.Process()
    assert current_rss_bytes() == pytest.approx(process.memory_info().rss, rel=0.05)
    assert peak_rss_bytes() >= process.memory_info().rss * 0.95


def test_peak_memory_logs_rss_per_step_and_keeps_the_peak(tmp_path):
    memory = PeakMemory()
    trainer = make_trainer(tmp_path, [memory], max_steps=4)
    trainer.fit(Ballast(), loader())
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("memory/rss_gib")]
    rss = [float(r["memory/rss_gib"]) for r in rows]
    assert len(rss) == 4
    grown = (rss[2] - rss[1]) * GIB
    assert grown == pytest.approx(BALLAST_BYTES, rel=0.25)
    summary = memory.summary()
    assert summary["peak_rss_gib"] >= max(rss) * 0.99
    assert summary["peak_rss_gib"] == pytest.approx(peak_rss_bytes() / GIB, rel=0.05)
    # no CUDA here: no device figures, rather than zeros
    assert summary["peak_allocated_gib"] is None and summary["peak_reserved_gib"] is None
