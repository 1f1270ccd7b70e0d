"""Callbacks Lightning lacks: throughput (tokens/s/GPU, TFLOP/s/GPU, MFU), peak memory, health (NaN/inf
skip or stop) and the run card (``run_card.json`` / ``run_card.md``).

Imported on first use, so ``lightning-moe report`` does not load Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "HealthCheck": "lightning_moe.callbacks.health",
    "PeakMemory": "lightning_moe.callbacks.memory",
    "RunCard": "lightning_moe.callbacks.run_card",
    "Throughput": "lightning_moe.callbacks.throughput",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_moe.callbacks' has no attribute {name!r}")
