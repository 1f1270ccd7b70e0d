"""Verdicts of the first-use checks of compiled kernels, per process.

A compiled kernel (inductor's generated C++ or Triton code) can be wrong on one machine and right on the next:
the code depends on the CPU's vector ISA or the GPU's architecture. The package checks each compiled kernel
against an eager computation the first time it runs with a new signature (device type, dtype, shapes, grad mode);
a kernel that computes wrong values or fails to build is recorded as broken for its (device type, dtype), warned
about once, and replaced by a correct path from then on. The verdicts land in the run card (``kernel_checks``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch


class KernelCheckWarning(UserWarning):
    """A compiled kernel failed its check on this machine; the package uses a correct fallback instead."""


# normalized max error (max |got - expected| / max |expected|) a correct kernel stays under, by dtype
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
HALF_TOLERANCE = 5e-2  # bf16 / fp16: rounding of inputs and partial sums

_verdicts: dict[tuple, dict[str, Any]] = {}
_broken: dict[tuple[str, str, str], dict[str, Any]] = {}


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, HALF_TOLERANCE)


def machine(device: torch.device) -> str:
    """What the compiled code was generated for: the CPU's vector ISA, or the GPU and its architecture."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where = f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    else:
        where = f"{device.type} (CPU capability {torch.backends.cpu.get_cpu_capability()})"
    return f"{where}, torch {torch.__version__}"


def normalized_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach().double(), expected.detach().double()
    if not torch.isfinite(got).all():
        return float("inf")
    scale = expected.abs().max().clamp_min(1e-12)
    return ((got - expected).abs().max() / scale).item()


def is_broken(kernel: str, device: torch.device, dtype: torch.dtype) -> bool:
    return (kernel, device.type, str(dtype).removeprefix("torch.")) in _broken


def _key(kernel: str, device: torch.device, dtype: torch.dtype, signature: tuple) -> tuple:
    return (kernel, device.type, str(dtype).removeprefix("torch."), *signature)


def is_checked(kernel: str, device: torch.device, dtype: torch.dtype, signature: tuple) -> bool:
    return _key(kernel, device, dtype, signature) in _verdicts


def run_check(kernel: str, device: torch.device, dtype: torch.dtype, signature: tuple, fallback: str,
              check: Callable[[], dict[str, float]]) -> bool:
    """Run ``check`` (returns named normalized errors of the compiled kernel against its reference) once for
    this ``signature``; record the verdict; warn once per broken (kernel, device type, dtype). True: the
    kernel is usable."""
    start = time.perf_counter()
    verdict: dict[str, Any] = {"kernel": kernel, "device": device.type, "dtype": str(dtype).removeprefix("torch."),
                               "signature": ", ".join(str(part) for part in signature), "machine": machine(device)}
    try:
        errors = check()
    except Exception as error:  # noqa: BLE001 - a kernel that fails to build or run is a failed check
        message = str(error).strip().splitlines()
        verdict.update(status="error", error=f"{type(error).__name__}: {message[0] if message else ''}"[:500])
    else:
        worst = max(errors.values(), default=0.0)
        verdict.update(status="ok" if worst <= tolerance(dtype) else "wrong", max_error=worst,
                       tolerance=tolerance(dtype), errors=errors)
    verdict["seconds"] = round(time.perf_counter() - start, 4)
    ok = verdict["status"] == "ok"
    verdict["used"] = "compiled" if ok else fallback
    _verdicts[_key(kernel, device, dtype, signature)] = verdict
    if not ok:
        broken_key = (kernel, device.type, verdict["dtype"])
        if broken_key not in _broken:
            _broken[broken_key] = verdict
            problem = (f"computes wrong values (normalized max error {verdict['max_error']:.3g} > "
                       f"{verdict['tolerance']:.0e})" if verdict["status"] == "wrong"
                       else f"fails ({verdict['error']})")
            warnings.warn(f"compiled {kernel} {problem} on {verdict['machine']} for {verdict['dtype']} "
                          f"[{verdict['signature']}]; using {fallback} instead for every {kernel} on "
                          f"{device.type}/{verdict['dtype']} in this process", KernelCheckWarning, stacklevel=3)
    return ok


def kernel_checks() -> list[dict[str, Any]]:
    """Every verdict of this process, in the order the checks ran (the run card's ``kernel_checks``)."""
    return [dict(v) for v in _verdicts.values()]


def reset_kernel_checks() -> None:
    """Forget all verdicts (tests; or after swapping the compiled code, e.g. ``torch._dynamo.reset()``)."""
    _verdicts.clear()
    _broken.clear()
