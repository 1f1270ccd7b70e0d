"""Comparisons against a reference implementation, with tolerances derived from the dtype and the magnitude.

A comparison of two fp32 implementations sits on a knife's edge: each rounds differently, and which of them is
"right" is not known. Here both are compared with a float64 reference instead:

- :class:`TrueFloat64` runs a reference model (transformers') in real float64: its explicit fp32 upcasts (RMSNorm's
  ``hidden_states.to(torch.float32)``, rotary ``.float()``, fp32 scratch buffers) would otherwise cap a ``.double()``
  model at fp32 accuracy.
- :func:`assert_matches` checks a result against that reference within ``factor * eps(dtype) * max|reference|``:
  a float64 comparison with a large factor is far from rounding (1e-16) and far below any real difference (1e-6 and
  up), so it holds on every machine and still fails on a wrong formula; an fp32 comparison measures the fp32
  implementation's own accuracy.

Each check returns its margin (worst error over tolerance); with ``LIGHTNING_MOE_MARGINS=FILE`` set, every check
appends ``{"test", "what", "margin"}`` to FILE as a JSON line, which is how the margins in the README are measured.
"""

from __future__ import annotations

import json
import os

import torch
from torch.overrides import TorchFunctionMode


def _record(what: str, margin: float) -> None:
    path = os.environ.get("LIGHTNING_MOE_MARGINS")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "what": what, "margin": margin}) + "\n")


def assert_within(got: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float = 0.0,
                  what: str = "") -> float:
    """``|got - expected| <= atol + rtol * |expected|`` elementwise (torch.testing's rule), computed in float64;
    returns the margin, the worst ratio of error to allowance."""
    got, expected = got.detach().double(), expected.detach().double()
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    error = (got - expected).abs()
    allowed = atol + rtol * expected.abs()
    margin = (error / allowed).max().item() if error.numel() else 0.0
    _record(what, margin)
    worst = int((error / allowed).argmax()) if error.numel() else 0
    assert margin <= 1.0, (f"{what}: max error {error.max().item():.3e} (margin {margin:.2f} at flat index {worst}: "
                           f"got {got.flatten()[worst].item():.6e}, expected {expected.flatten()[worst].item():.6e}; "
                           f"atol {atol:.1e}, rtol {rtol:.1e})")
    return margin


def tolerance(reference: torch.Tensor, dtype: torch.dtype, factor: float) -> float:
    """``factor`` units of ``dtype``'s rounding at the reference's largest magnitude."""
    return factor * torch.finfo(dtype).eps * reference.detach().abs().max().item()


# How many units of rounding a tiny model's forward, or a training step's gradients, may accumulate against the
# float64 truth. float64: 2^16 eps = 1.5e-11 of the largest value, about 500 times the errors seen (1e-14 to 4e-14
# of it) and five orders of magnitude below the smallest real difference (an fp32 rounding step in one formula,
# 1e-7). float32: 2^11 eps = 2.4e-4 of the largest value; the fp32 errors seen are up to 2^8 eps for gradients
# and 2^6 eps for logits, for this package and for transformers alike.
FACTOR = {torch.float64: 2.0**16, torch.float32: 2.0**11}


def assert_matches(got: torch.Tensor, reference: torch.Tensor, *, dtype: torch.dtype | None = None,
                   factor: float | None = None, what: str = "") -> float:
    """``got`` (computed in ``dtype``, default its own) equals the float64 ``reference`` within ``FACTOR[dtype]``
    units of ``dtype``'s rounding at the reference's magnitude."""
    dtype = dtype or got.dtype
    assert reference.dtype == torch.float64, f"{what}: the reference must be float64, not {reference.dtype}"
    scale = reference.detach().abs().max().item()
    assert scale > 0, f"{what}: the reference is all zeros, a comparison that cannot fail"
    atol = tolerance(reference, dtype, FACTOR[dtype] if factor is None else factor)
    return assert_within(got, reference, atol=atol, what=what)


_UPCASTS = {torch.float32, torch.float16, torch.bfloat16}


def _as_float64(value):
    return torch.float64 if value in _UPCASTS else value


def _grouped_mm_float64(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, **_) -> torch.Tensor:
    """torch's grouped GEMM has no float64 kernel: the same products, group by group."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if a.dim() == 2 and b.dim() == 2:  # [out, N] x [N, in] summed per group -> [G, out, in]
        return torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])
    rows = [a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, ends))]
    return torch.cat(rows + [a.new_zeros(a.shape[0] - ends[-1], b.shape[-1])])


_GROUPED_MM = {torch._grouped_mm, torch.nn.functional.grouped_mm}


class TrueFloat64(TorchFunctionMode):
    """Within this mode, every request for a floating dtype below float64 (``.float()``, ``.to(torch.float32)``,
    ``dtype=torch.float32`` of a factory or reduction, ``.type(...)``) gets float64 instead, so a model made
    ``.double()`` computes in float64 throughout, including where its code upcasts to fp32 on purpose."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _GROUPED_MM and args[0].dtype == torch.float64:
            return _grouped_mm_float64(*args, **kwargs)
        if func in (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16):
            return args[0].double()
        if "dtype" in kwargs:
            kwargs["dtype"] = _as_float64(kwargs["dtype"])
        if func in (torch.Tensor.to, torch.Tensor.type):
            args = tuple(_as_float64(a) if isinstance(a, torch.dtype) else a for a in args)
        return func(*args, **kwargs)



def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of ``model`` (the original keeps its dtype and gradients)."""
    import copy

    return copy.deepcopy(model).double()


def _as_dict(result) -> dict:
    return result if isinstance(result, dict) else {"": result}


def assert_matches_float64_reference(native: torch.nn.Module, reference: torch.nn.Module, run_native,
                                     run_reference=None, what: str = "") -> float:
    """``run_native(model)`` on ``native`` as it is (fp32) and on its float64 copy equals ``run_reference(model)``
    (default ``run_native``) on a float64 copy of ``reference`` run in :class:`TrueFloat64`: the float64 result
    within float64 rounding, the fp32 one within fp32 rounding. Each returns a tensor or a dict of tensors with
    the same keys. Returns the largest margin."""
    with TrueFloat64():
        expected = _as_dict((run_reference or run_native)(float64_copy(reference)))
    margins = []
    for model in (float64_copy(native), native):
        got = _as_dict(run_native(model))
        assert got.keys() == expected.keys(), f"{what}: {sorted(got)} != {sorted(expected)}"
        dtype = next(model.parameters()).dtype
        for key, value in got.items():
            label = " ".join(part for part in (what, key, f"({dtype})") if part)
            margins.append(assert_matches(value, expected[key], dtype=dtype, what=label))
    return max(margins)
