"""Peak dense matmul FLOP/s per device, the denominator of MFU.

Datasheet figures without structured sparsity. ``fp8`` is twice ``bf16`` on Hopper and Blackwell, ``mxfp8``
(block-scaled FP8) exists on Blackwell only, ``tf32`` (fp32 matmuls with TF32 enabled) is half of ``bf16``.
Keys are fragments of ``torch.cuda.get_device_name()``; the longest matching fragment wins, so
``"H100 PCIe"`` beats ``"H100"`` and ``"GB200"`` beats ``"B200"``.

On CPU the peak is measured: the best rate of a large square matmul in the training dtype, once per machine
(processor, threads, torch build), cached in the user's cache folder; so is the memory bandwidth the planner's
``cpu`` hardware row takes (:func:`cpu_memory_bandwidth`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from lightning_moe.io.atomic import atomic_write_text

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


CPU_PEAK_CACHE = "cpu_peak_flops.json"
CPU_BANDWIDTH_CACHE = "cpu_memory_bandwidth.json"
CPU_PEAK_SIZE = 2048  # a square matmul large enough to reach the BLAS kernel's steady rate
CPU_BANDWIDTH_MIB = 128  # a copy far larger than the last-level cache


def cpu_cache_path(name: str) -> Path:
    root = os.environ.get("LIGHTNING_MOE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lightning_moe")
    return Path(root) / name


def cpu_machine() -> str:
    """What a measurement on this CPU depends on: processor, threads, vector capability and torch build."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), model)
    except OSError:
        pass
    return (f"{model} | threads {torch.get_num_threads()} | {torch.backends.cpu.get_cpu_capability()} | "
            f"torch {torch.__version__}")


def cpu_identity(dtype: torch.dtype) -> str:
    """What a measured CPU peak depends on: :func:`cpu_machine` and the dtype."""
    return f"{cpu_machine()} | {str(dtype).removeprefix('torch.')}"


def measure_cpu_peak_flops(dtype: torch.dtype, size: int = CPU_PEAK_SIZE, repeats: int = 3) -> float:
    """The best of ``repeats`` timed ``size``^3 matmuls in ``dtype`` on this process's threads, in FLOP/s."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm the kernel and the pages
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def _cached_measurement(path: Path, key: str, measure) -> float:
    """``measure()`` once per ``key``, kept in ``path`` (a JSON of ``{key: figure}``, editable to pin one)."""
    try:
        cached = json.loads(path.read_text())
    except FileNotFoundError:
        cached = {}
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable CPU measurement cache ({error}); delete it to measure again") from error
    if key not in cached:
        cached[key] = measure()
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(cached, indent=2) + "\n")
    return float(cached[key])


def cpu_peak_flops(dtype: torch.dtype) -> tuple[float, str]:
    """This machine's measured matmul peak in ``dtype``, measured once and cached per :func:`cpu_identity`
    (the cache file, a JSON of ``{identity: FLOP/s}``, may be edited to pin a figure). Returns the figure and
    where it came from."""
    path = cpu_cache_path(CPU_PEAK_CACHE)
    peak = _cached_measurement(path, cpu_identity(dtype), lambda: measure_cpu_peak_flops(dtype))
    return peak, f"measured {CPU_PEAK_SIZE}^3 matmul on this CPU (cached in {path})"


def measure_cpu_memory_bandwidth(mib: int = CPU_BANDWIDTH_MIB, repeats: int = 3) -> float:
    """The best of ``repeats`` timed copies of a ``mib`` MiB buffer into another on this process's threads, in
    bytes per second (read + written)."""
    source = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)  # fault the pages in
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2.0 * source.numel() * source.element_size() / best


def cpu_memory_bandwidth() -> tuple[float, str]:
    """This machine's measured memory bandwidth (a large tensor copy), measured once and cached per processor,
    threads and torch build. Returns the figure and where it came from."""
    path = cpu_cache_path(CPU_BANDWIDTH_CACHE)
    bandwidth = _cached_measurement(path, cpu_machine(), measure_cpu_memory_bandwidth)
    return bandwidth, f"measured {CPU_BANDWIDTH_MIB} MiB copy on this CPU (cached in {path})"
