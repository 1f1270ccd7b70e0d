"""Callbacks Lightning lacks: throughput (tokens/s/GPU, TFLOP/s/GPU, MFU), peak memory, health (NaN/inf
skip or stop) and the run card (``run_card.json`` / ``run_card.md``).

Imported on first use, so ``lightning-moe report`` does not load Lightning.
"""

from __future__ import annotations

from lightning_moe.lazy import lazy_exports

_PUBLIC = {
    "HealthCheck": "lightning_moe.callbacks.health",
    "PeakMemory": "lightning_moe.callbacks.memory",
    "RunCard": "lightning_moe.callbacks.run_card",
    "Throughput": "lightning_moe.callbacks.throughput",
}

__all__ = sorted(_PUBLIC)


__getattr__ = lazy_exports(__name__, _PUBLIC)
