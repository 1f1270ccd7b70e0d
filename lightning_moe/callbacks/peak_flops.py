"""Peak dense matmul FLOP/s per device, the denominator of MFU.

Datasheet figures without structured sparsity. ``fp8`` is twice ``bf16`` on Hopper and Blackwell, ``mxfp8``
(block-scaled FP8) exists on Blackwell only, ``tf32`` (fp32 matmuls with TF32 enabled) is half of ``bf16``.
Keys are fragments of ``torch.cuda.get_device_name()``; the longest matching fragment wins, so
``"H100 PCIe"`` beats ``"H100"`` and ``"GB200"`` beats ``"B200"``.
"""

from __future__ import annotations

import torch

PEAK_FLOPS: dict[str, dict[str, float]] = {
    "GB200": {"bf16": 2.5e15, "fp8": 5.0e15, "mxfp8": 5.0e15, "tf32": 1.25e15},
    "B200": {"bf16": 2.25e15, "fp8": 4.5e15, "mxfp8": 4.5e15, "tf32": 1.125e15},
    "H200": {"bf16": 989e12, "fp8": 1979e12, "tf32": 494.5e12},
    "H200 NVL": {"bf16": 835.5e12, "fp8": 1671e12, "tf32": 417.5e12},
    "H100": {"bf16": 989e12, "fp8": 1979e12, "tf32": 494.5e12},
    "H100 NVL": {"bf16": 835.5e12, "fp8": 1671e12, "tf32": 417.5e12},
    "H100 PCIe": {"bf16": 756.5e12, "fp8": 1513e12, "tf32": 378e12},
    "A100": {"bf16": 312e12, "tf32": 156e12},
}


def matmul_precision(trainer_precision: str) -> str:
    """The peak column of a Lightning precision string (``"bf16-mixed"``, ``"32-true"``, ...)."""
    if trainer_precision.startswith(("bf16", "16")):
        return "bf16"  # fp16 tensor cores run at the bf16 rate
    if trainer_precision.startswith("32"):
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return trainer_precision


def lookup_peak_flops(device_name: str, precision: str, overrides: dict[str, float] | None = None) -> float | None:
    """Peak FLOP/s of ``device_name`` at ``precision``; ``overrides`` ({name fragment: FLOP/s}) win over the
    table. None when unknown (MFU is then not reported)."""
    for fragment in sorted(overrides or {}, key=len, reverse=True):
        if fragment.lower() in device_name.lower():
            return float(overrides[fragment])
    for fragment in sorted(PEAK_FLOPS, key=len, reverse=True):
        if fragment.lower() in device_name.lower():
            return PEAK_FLOPS[fragment].get(precision)
    return None
