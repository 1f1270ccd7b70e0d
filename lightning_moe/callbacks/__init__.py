"""Callbacks Lightning lacks: throughput (tokens/s/GPU, TFLOP/s/GPU, MFU), peak memory, health (NaN/inf
skip or stop), preemption (SIGTERM / Slurm requeue: save at the step's end, then exit or requeue) and the run
card (``run_card.json`` / ``run_card.md``); a progress bar in optimizer steps (plain lines when the output is not
a terminal), validation intervals in optimizer steps, ``predict`` results as JSON lines, and a model summary with
model FLOPs in place of Lightning's.

Imported on first use, so ``lightning-moe report`` does not load Lightning.
"""

from __future__ import annotations

from lightning_moe.lazy import lazy_exports

_PUBLIC = {
    "HealthCheck": "lightning_moe.callbacks.health",
    "ModelSummary": "lightning_moe.callbacks.summary",
    "PeakMemory": "lightning_moe.callbacks.memory",
    "Preempted": "lightning_moe.callbacks.preemption",
    "Preemption": "lightning_moe.callbacks.preemption",
    "PredictionWriter": "lightning_moe.callbacks.prediction_writer",
    "RunCard": "lightning_moe.callbacks.run_card",
    "StepLines": "lightning_moe.callbacks.step_lines",
    "StepProgressBar": "lightning_moe.callbacks.progress",
    "Throughput": "lightning_moe.callbacks.throughput",
    "ValidationInSteps": "lightning_moe.callbacks.validation_steps",
}

__all__ = sorted(_PUBLIC)


__getattr__ = lazy_exports(__name__, _PUBLIC)
